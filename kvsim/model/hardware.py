"""Hardware presets (conf/hardware/<name>.yaml): one instance's accelerators, their peak
numbers and the fractions of them prefill and decode reach. `devices` is the tensor-parallel
degree of one prefill or decode instance: peak FLOP/s and HBM bandwidth scale with it (times
`tp_efficiency`)."""


from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from kvsim.core.checks import check_number


@dataclass
class HardwareSpec:
    name: str = MISSING
    hbm_gb_per_s: float = MISSING  # per device, GB/s (1e9 bytes/s)
    bf16_tflops: float = MISSING  # per device, dense bf16 peak, 1e12 FLOP/s
    memory_gb: float = MISSING  # per device, GB of accelerator memory
    devices: int = 1  # tensor-parallel degree of one instance
    tp_efficiency: float = 1.0  # fraction of linear scaling kept with `devices`
    prefill_mfu: float = 0.5  # fraction of peak FLOP/s a prefill reaches
    decode_mbu: float = 0.7  # fraction of HBM bandwidth a decode step reaches
    step_overhead_s: float = 0.0  # fixed cost per forward step (launches, sampling, sync)
    source: str = ""  # where the numbers come from
    profile: str = ""  # optional measured profile JSON overriding the roofline

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Finite, positive numbers (fields still MISSING while Hydra builds the schema are
        skipped: they are checked again when the composed config is validated)."""
        for key in ("hbm_gb_per_s", "bf16_tflops", "memory_gb", "prefill_mfu", "decode_mbu",
                    "tp_efficiency"):
            value = getattr(self, key)
            if isinstance(value, (int, float)):
                check_number(f"hardware {self.name}: {key}", value)
        for key in ("prefill_mfu", "decode_mbu", "tp_efficiency"):
            value = getattr(self, key)
            if isinstance(value, (int, float)) and value > 1:
                raise ValueError(f"hardware {self.name}: {key} is a fraction <= 1, got {value}")
        if isinstance(self.devices, int) and self.devices < 1:
            raise ValueError(f"hardware {self.name}: devices must be >= 1, got {self.devices}")
        if isinstance(self.step_overhead_s, (int, float)):
            check_number(f"hardware {self.name}: step_overhead_s", self.step_overhead_s,
                         strict=False)

    @property
    def scale(self) -> float:
        return self.devices * (self.tp_efficiency if self.devices > 1 else 1.0)

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gb_per_s * 1e9 * self.scale

    @property
    def flops_per_s(self) -> float:
        return self.bf16_tflops * 1e12 * self.scale
