"""Where a run writes (`RunPaths`), from the configuration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from skylift.config.schema import SkyliftConfig
from skylift.config.validation import default_run_root


@dataclasses.dataclass
class RunPaths:
    """Where a run writes: its root, checkpoints, exports and logs (`trainer.*_path`, `log_dir`)."""

    root: Path
    ckpt: Path
    export: Path
    logs: Path

    @classmethod
    def from_config(cls, cfg: SkyliftConfig) -> RunPaths:
        t = cfg.trainer
        return cls.of(t.run_name, t.runs_dir, t.ckpt_path, t.export_path, t.log_dir)

    @classmethod
    def of(
        cls, run_name: str, runs_dir: str | None, ckpt: str | None, export: str | None, logs: str | None
    ) -> RunPaths:
        """The paths from a run's keys (any run: `skylift train`'s `trainer.*`, `skylift sft`'s)."""
        root = default_run_root(run_name, runs_dir)
        return cls(
            root=root,
            ckpt=Path(ckpt).expanduser() if ckpt else root / "ckpts",
            export=Path(export).expanduser() if export else root / "exports",
            logs=Path(logs).expanduser() if logs else root / "logs",
        )
