"""The config's ``privacy`` section (:class:`PrivacyConfig`, ``Config.privacy``) and what it refuses of a method's upload
path (:func:`check_upload_path`, called when the config is validated)."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fedflat.core.errors import ConfigError
from fedflat.privacy.accounting import INSTANCE_PLD


class PrivacyConfig(BaseModel):
    """Client-level differential privacy (docs/privacy.md): each client's update clipped to ``clip``, Gaussian noise
    of std ``noise_multiplier * clip`` on the sum (central) or on each update (local), accounted with dp-accounting."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)  # as every section of the config

    level: Literal["client", "instance"] = Field("client", description="client: a client's whole data (DP-FedAvg); "
                                                                        "instance: each example, by DP-SGD on the client")
    mode: Literal["central", "local"] = Field("central", description="central: the server noises the sum "
                                                                      "(DP-FedAvg); local: each client its update")
    clip: float = Field(1.0, gt=0, description="C, the L2 bound of a client's update (the first C when adaptive), or "
                                                "of one example's gradient (level: instance)")
    noise_multiplier: float | None = Field(None, ge=0, description="z (noise std z C); with target_epsilon unset "
                                                                   "it must be given")
    target_epsilon: float | None = Field(None, gt=0, description="calibrate z before round 0 so that the run's "
                                                                 "`rounds` rounds spend at most this epsilon (local "
                                                                 "DP: its most-sampled client's); the budget")
    delta: float | None = Field(None, gt=0, lt=1, description="delta of (epsilon, delta) (default 1 / num_clients)")
    accountant: Literal["rdp", "pld"] = Field("rdp", description="dp-accounting's RDP (both samplings, DP-SGD) or "
                                                                  "PLD (Poisson sampling and local DP, tighter)")
    adaptive: bool = Field(False, description="adapt the clip to a quantile of the update norms (Andrew et al. 2021)")
    quantile: float = Field(0.5, gt=0, lt=1, description="adaptive: the target fraction of unclipped updates")
    clip_lr: float = Field(0.2, gt=0, description="adaptive: eta_C of C <- C exp(-eta_C (b - quantile))")
    count_noise: float | None = Field(None, gt=0, description="adaptive: std of the noise on the unclipped count "
                                                              "(default clients_per_round / 20)")
    noise: Literal["keyed", "secure"] = Field("keyed", description="keyed: reproducible streams (simulation); "
                                                                    "secure: the OS's CSPRNG (a deployment)")

    @model_validator(mode="after")
    def _noise_given(self) -> "PrivacyConfig":
        if self.noise_multiplier is None and self.target_epsilon is None:
            raise ValueError("privacy: set noise_multiplier (z) or target_epsilon (z is then calibrated)")
        if self.level == "instance" and (self.adaptive or self.mode != "central"):
            raise ValueError("privacy.level=instance runs DP-SGD inside each client's local steps: mode and adaptive "
                             "are client-level settings; leave them unset")
        if self.level == "instance" and self.accountant == "pld":
            raise ValueError(INSTANCE_PLD)
        if self.level == "instance" and self.noise_multiplier is None:
            raise ValueError("privacy.level=instance: give noise_multiplier (the per-client accounting depends on the "
                             "split, known only when the run starts); target_epsilon is then the budget")
        return self


def check_upload_path(privacy: PrivacyConfig | None, participation: str, algorithm: Any) -> None:
    """What the upload path under ``privacy`` (the config's section) cannot give a method (``algorithm``, a
    :class:`fedflat.algorithms.Algorithm`), refused with the reason: each client's own upload under central DP
    (which releases only the noised sum), compression under local DP (whose noise is dense), a Poisson accountant
    for fixed sampling (``participation``: ``sampling.participation``), what DP-SGD cannot account (instance
    level)."""
    p = privacy
    if p is None:
        return
    if p.level == "instance":
        beyond = algorithm.beyond_batch_needs()
        if beyond:
            raise ConfigError(f"privacy.level=instance privatizes each local step's gradients of its batch, but "
                              f"{'; '.join(beyond)}: DP-SGD cannot account that; use privacy.level=client")
        return
    needs = algorithm.individual_needs()
    if p.mode == "central" and needs:
        raise ConfigError(f"privacy.mode=central releases only the noised sum of the clients' updates, but "
                          f"{'; '.join(needs)}: this method would read what central DP hides. Use privacy.mode=local "
                          "(each client noises its own update) or another method")
    if p.mode == "local" and algorithm.path.encoder is not None:
        raise ConfigError(f"compression ({algorithm.path.encoder.name}) with privacy.mode=local: local noise makes the "
                          "update dense; compress under privacy.mode=central")
    if p.accountant == "pld" and p.mode == "central" and participation != "bernoulli":
        raise ConfigError("privacy.accountant=pld accounts Poisson sampling: set sampling.participation=bernoulli, "
                          "or use privacy.accountant=rdp (fixed-size sampling)")
