"""The engine that runs rounds: the round loop (:mod:`fedflat.engine.simulation`), the client contract
(:mod:`fedflat.engine.client`), where clients run (:mod:`fedflat.engine.runtime`, in this process;
:mod:`fedflat.engine.ray_executor`, on Ray workers), the client-state store, batches, the gradient oracle,
threads and the checkpoint file."""
