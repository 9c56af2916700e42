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
        root = default_run_root(t.run_name, t.runs_dir)
        return cls(
            root=root,
            ckpt=Path(t.ckpt_path).expanduser() if t.ckpt_path else root / "ckpts",
            export=Path(t.export_path).expanduser() if t.export_path else root / "exports",
            logs=Path(t.log_dir).expanduser() if t.log_dir else root / "logs",
        )
