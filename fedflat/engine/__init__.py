"""The engine that runs rounds: the round loop (:mod:`fedflat.engine.simulation`), the client contract
(:mod:`fedflat.engine.client`), where clients run (:mod:`fedflat.engine.runtime`, in this process;
:mod:`fedflat.engine.ray_executor`, on Ray workers), the client-state store, batches, the gradient oracle and its
backends (:mod:`fedflat.engine.gradients`), the run's compute options and a user's inputs
(:mod:`fedflat.engine.compute`, :mod:`fedflat.engine.inputs`), torch thread counts and core shares
(:mod:`fedflat.engine.cores`) and the checkpoint file (:mod:`fedflat.engine.checkpoint`)."""
