"""An attack as a plugin: the mimic attack (Karimireddy, He and Jaggi, "Byzantine-robust learning on heterogeneous
datasets via bucketing", ICLR 2022), simplified: every malicious client of a round uploads the same benign client's
update, the benign update farthest from the benign mean (the paper picks that client once, by the top principal
direction of a warm-up phase). On non-IID data this over-weights one client's data without ever leaving the honest
updates' spread.

It follows the contract of an upload stage of kind ``attack`` (docs/extending.md, "Your own robust rule or attack"):

- subclass :class:`fedflat.algorithms.attacks.Attack`: it has the ``fraction`` option (``attack.fraction``),
  :meth:`~fedflat.algorithms.attacks.Attack.malicious` (which clients of a set of ids are the run's attackers, the
  same on every engine, executor and Flower node; :func:`fedflat.algorithms.attacks.is_malicious` outside a
  subclass), and logs the round's ``attackers``;
- an attack that needs the other clients' updates (colluding, as this one) acts in :meth:`server`, which runs first
  among the server's stages on the round's whole release: :meth:`client` sees one chunk of clients at a time (one
  client on the sequential engine);
- change only the malicious rows, return new tensors.

    fedflat run examples/stages/stages.yaml
"""
from __future__ import annotations

from fedflat.algorithms.attacks import Attack, rows_where
from fedflat.core import MODEL, register_part
from fedflat.core.upload import Release


class Mimic(Attack):
    """Every malicious client uploads the benign update farthest from the benign mean (module docstring)."""

    name = "mimic"
    summary = "attack (plugin): colluding clients copy the benign update farthest from the benign mean"

    def server(self, ctx, release: Release) -> Release:
        release = super().server(ctx, release)  # logs the round's attackers
        delta = release[MODEL]
        bad = self.malicious(ctx.settings, ctx.sampled).to(delta.device)
        if not bad.any() or bad.all():
            return release
        benign = delta[~bad]
        far = benign[(benign - benign.mean(0)).double().norm(dim=1).argmax()]
        return {**release, MODEL: rows_where(bad, far.expand_as(delta), delta)}


register_part(Mimic)
