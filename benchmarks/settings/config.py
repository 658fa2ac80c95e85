"""The benchmark's configuration: one dataclass, every field a command-line option.

``python -m benchmarks --help`` lists the options; each field ``foo_bar``
becomes ``--foo-bar``.  Tuples take comma-separated values
(``--batch-sizes 512,4096``), booleans take ``--x`` / ``--no-x``.

``--preset NAME`` sets several fields at once (:data:`PRESETS`); options
given on the command line still win, and the run is named after the preset
unless ``--name`` is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass, fields
from typing import Any, Dict, List, Optional, Sequence, Tuple

from trec_pipelines.testing.dlrm_spec import INTERACTIONS, SHARDING_TYPES, ModelSpec

# Ids per sample of each of the 26 tables of MLPerf's DLRM-DCNv2 reference
# (its multi-hot sizes; 214 in all).
DLRM_DCNV2_POOLINGS: Tuple[int, ...] = (
    3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1,
)  # fmt: skip
DLRM_BATCH = 256

_DLRM_DCNV2: Dict[str, Any] = {
    "dims": (128,) * len(DLRM_DCNV2_POOLINGS),
    "poolings": DLRM_DCNV2_POOLINGS,
    "interaction": "dcn",
    "dcn_layers": 3,
    "dcn_rank": 16,
    "rows": 5_000,
    "dense_arch": (256, 128),
    "over_arch": (128, 64),
    "batch_sizes": (DLRM_BATCH,),
    "steps": (12,),
    "repeats": 5,
    "warmup_steps": 3,
    "link_gbit": 1.0,
    "memory": False,
    "memory_options": False,
    "overhead": False,
}

# Named sets of field values (``--preset``).  Each says in its comment what it is for.
PRESETS: Dict[str, Dict[str, Any]] = {
    # Input dist comparable to compute, so pipelining has something to hide:
    # 16 narrow tables (dim 8: little lookup and update work per id) with
    # ~32 ids per sample, so the ids all-to-all (~4.3 MB a step over both
    # ranks) takes ~34 ms over an emulated 1 Gbit/s link, against ~40-90 ms
    # of fwd+bwd+opt on this 2-core machine.  One batch size, 5 repeats of
    # 12 steps, and no memory or overhead measurements keep it to a few
    # minutes with torchrec's classes.  Without root (no emulated link) it runs over the
    # loopback, where the input dist is cheap: the results say so.
    "pipelining": {
        "dims": (8,) * 16,
        "pooling": 32,
        "batch_sizes": (1024,),
        "steps": (12,),
        "repeats": 5,
        "warmup_steps": 3,
        "link_gbit": 1.0,
        # Ours with the input dist on a dedicated group (the default) and on the
        # model's group, each next to torchrec (always the model's group).
        "input_dist_groups": ("dedicated", "shared"),
        "memory": False,
        "memory_options": False,
        "overhead": False,
    },
    # The other regime: MLPerf's DLRM-DCNv2 shapes (26 tables of dim 128, the
    # reference's multi-hot bag size per table, 214 ids per sample; a low-rank
    # DCNv2 cross network), where the embeddings' output all-to-all (~13 KB per
    # sample forward, as much backward) outweighs the ids (~1.7 KB per sample)
    # about 15 to 1: the input dist is a small part of the link's bytes.  Rows,
    # the cross network's rank and the top MLP are scaled down to fit every
    # contender's model on this machine and a plain step of ~50-150 ms at batch
    # DLRM_BATCH on 2 cores, over an emulated 1 Gbit/s link.
    "dlrm-dcnv2": _DLRM_DCNV2,
    # The same over an emulated 10 Gbit/s link (a second run: one run, one link).
    "dlrm-dcnv2-10gbit": dict(_DLRM_DCNV2, link_gbit=10.0),
}


def _as_flags(values: Dict[str, Any]) -> str:
    """Field values as the command-line options that set them."""
    flags = []
    for name, value in values.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, tuple):
            flags.append(f"--{flag} {','.join(str(v) for v in value)}")
        else:
            flags.append(f"--{flag} {value:g}" if isinstance(value, float) else f"--{flag} {value}")
    return " ".join(flags)


# Help for each field, shown by --help and kept next to the defaults.
_HELP: Dict[str, str] = {
    "nproc": "ranks (gloo processes) launched by torchrun",
    "sharding_type": f"sharding of every table: {', '.join(SHARDING_TYPES)}",
    "batch_sizes": "per-rank batch sizes to measure: one overhead-bound, one compute-bound",
    "steps": "batches per timed epoch, one value per batch size or one for all "
    "(default: 24 up to batch 1024, else 8)",
    "repeats": "timed epochs per contender; the result is their median",
    "warmup_steps": "batches of the untimed warm-up epoch before the first repeat",
    "rows": "rows of every embedding table",
    "dims": "embedding dimension of each table (their count is the number of tables)",
    "pooling": "mean ids per sample and feature (bag lengths uniform in [0, 2 x pooling])",
    "poolings": "fixed ids per sample of each table, one value per table (multi-hot bags of "
    "fixed size, as in MLPerf's DLRM-DCNv2); replaces --pooling (default: none)",
    "interaction": "how the dense output meets the pooled embeddings: 'concat', or 'dcn' "
    "(concatenated, then a low-rank DCNv2 cross network)",
    "dcn_layers": "cross layers of --interaction dcn",
    "dcn_rank": "rank of each cross layer's low-rank weight (--interaction dcn)",
    "dense_in": "dense input features",
    "dense_arch": "hidden sizes of the bottom MLP",
    "over_arch": "hidden sizes of the top MLP",
    "emb_lr": "learning rate of the fused (in-backward) embedding Adagrad",
    "dense_lr": "learning rate of the dense Adagrad",
    "variants": "only these pipeline classes (default: every one trec_pipelines exports)",
    "include_compiled": "also run TrainPipelinePT2 and TrainPipelineSparseDistCompAutograd "
    "(compile time is excluded by the warm-up)",
    "torchrec": "run torchrec's same-named classes next to ours",
    "overhead": "measure per-step pipeline overhead on the tiny model",
    "overhead_batch_size": "per-rank batch size of the overhead measurement",
    "overhead_steps": "batches per timed epoch of the overhead measurement",
    "overhead_repeats": "rounds of the overhead measurement (its differences are small: more rounds than --repeats)",
    "stages": "measure SparseDist's stages separately (H2D, input dist, fwd+bwd+opt; CPU and link "
    "bytes) for the bound and the hidden input dist",
    "timelines": "also draw, into timelines/, a schedule timeline PNG per variant of ours (from its "
    "recorded epoch, which also runs with --stages) and its memory figure, and store what they are "
    "drawn from in results.json; off: the run draws its summary figure, qps.png, alone",
    "timeline_steps": "batches of the recorded epoch per variant of ours (timeline, hidden input dist, link-order gap)",
    "memory": "measure what each pipeline holds (tensor storage reachable from it, per step; "
    "ours also per action) and the RSS, in separate untimed epochs",
    "memory_options": "also measure what SparseDist's enable_inplace_copy_batch / "
    "free_features_storage_early / clear_data_dist_inputs save, at the largest batch size "
    "(builds a model and pipeline per option set and library)",
    "memory_steps": "batches of each memory-measuring epoch",
    "link_gbit": "emulate an interconnect of this many Gbit/s (private network namespace, tbf on its "
    "loopback) (default: none, the plain loopback)",
    "link_socket_queue_kb": "KiB each TCP socket may queue for the emulated link "
    "(tcp_limit_output_bytes in the namespace; "
    "0 keeps the kernel's default, a queue deep enough for one all-to-all to hold up every other flow: "
    "see [Note: the link's queue] in benchmarks/settings/netns.py)",
    "input_dist_groups": "input_dist_group settings each of our pipelines that takes the option runs with "
    "(the first with its plain key, the others as their own rows, e.g. 'TrainPipelineSparseDist [shared]')",
    "agreement_off": "also run each of our pipelines with sync_exhaustion=False (no agreement on "
    "each pulled batch), as its own row, e.g. 'TrainPipelineSparseDist [no agreement]': what the "
    "agreement costs, paired",
    "threads": "intra-op threads per rank",
    "seed": "seed of the model weights and the synthetic batches",
    "out_dir": "where results go (a sub-directory per run name)",
    "name": "run name (default: the preset's name, else 'link-<G>gbit' with --link-gbit, else 'default')",
    "preset": "set several options at once (those given on the command line win): "
    + "; ".join(f"{name} = {_as_flags(values)}" for name, values in PRESETS.items())
    + " (default: none)",
    "progress": "show a progress bar",
    "pg_timeout_s": "seconds before a stuck collective fails (a failing contender then becomes n/a)",
}


@dataclass
class BenchConfig:
    """Everything that defines a benchmark run (defaults: the run ``make bench`` does)."""

    nproc: int = 2
    sharding_type: str = "table_wise"
    batch_sizes: Tuple[int, ...] = (512, 4096)
    steps: Tuple[int, ...] = ()
    repeats: int = 7
    warmup_steps: int = 6
    rows: int = 100_000
    dims: Tuple[int, ...] = (16, 32, 64, 24, 48, 16, 32, 64)
    pooling: int = 8
    poolings: Tuple[int, ...] = ()
    interaction: str = "concat"
    dcn_layers: int = 3
    dcn_rank: int = 64
    dense_in: int = 13
    dense_arch: Tuple[int, ...] = (128, 64)
    over_arch: Tuple[int, ...] = (128, 64)
    emb_lr: float = 0.05
    dense_lr: float = 0.01
    variants: Tuple[str, ...] = ()
    include_compiled: bool = False
    torchrec: bool = True
    overhead: bool = True
    overhead_batch_size: int = 32
    overhead_steps: int = 200
    overhead_repeats: int = 21
    stages: bool = True
    timelines: bool = False
    timeline_steps: int = 7
    memory: bool = True
    memory_options: bool = True
    memory_steps: int = 8
    link_gbit: Optional[float] = None
    link_socket_queue_kb: int = 256
    input_dist_groups: Tuple[str, ...] = ("dedicated",)
    agreement_off: bool = False
    threads: int = 1
    seed: int = 0
    out_dir: str = "benchmarks/results"
    name: str = ""
    preset: str = ""
    progress: bool = True
    pg_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise ValueError(f"--nproc must be >= 1, got {self.nproc}")
        if self.sharding_type not in SHARDING_TYPES:
            raise ValueError(
                f"--sharding-type must be one of {SHARDING_TYPES}, got {self.sharding_type!r}"
            )
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"--batch-sizes needs positive sizes, got {self.batch_sizes}")
        if len(self.steps) not in (0, 1, len(self.batch_sizes)):
            raise ValueError(
                f"--steps takes one value or one per batch size ({len(self.batch_sizes)}), got {self.steps}"
            )
        if self.steps and min(self.steps) < 2:
            raise ValueError(
                f"--steps must be >= 2 (a pipeline needs a few batches), got {self.steps}"
            )
        if self.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {self.repeats}")
        if self.overhead_repeats < 1:
            raise ValueError(f"--overhead-repeats must be >= 1, got {self.overhead_repeats}")
        if not self.dims or self.pooling < 1 or self.rows < 1:
            raise ValueError("--dims, --pooling and --rows must be non-empty / positive")
        self._check_model()
        if self.link_gbit is not None and self.link_gbit <= 0:
            raise ValueError(f"--link-gbit must be > 0 Gbit/s, got {self.link_gbit}")
        if self.link_socket_queue_kb < 0:
            raise ValueError(
                f"--link-socket-queue-kb must be >= 0 (0: the kernel's default), got {self.link_socket_queue_kb}"
            )
        if (
            not self.input_dist_groups
            or not set(self.input_dist_groups) <= {"dedicated", "shared"}
            or len(set(self.input_dist_groups)) != len(self.input_dist_groups)
        ):
            raise ValueError(
                "--input-dist-groups takes 'dedicated' and/or 'shared', each once, got "
                f"{','.join(self.input_dist_groups) or '(none)'}"
            )
        if self.memory_steps < 3:
            raise ValueError(
                f"--memory-steps must be >= 3 (a pipeline fills with up to 3 batches), got {self.memory_steps}"
            )
        if self.preset and self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}, got {self.preset!r}")
        if self.timeline_steps < 6:
            raise ValueError(
                f"--timeline-steps must be >= 6 to draw progress() calls 2..5, got {self.timeline_steps}"
            )

    def _check_model(self) -> None:
        if self.poolings and len(self.poolings) != len(self.dims):
            raise ValueError(
                f"--poolings takes one bag size per table of --dims ({len(self.dims)}), "
                f"got {len(self.poolings)}"
            )
        if self.poolings and min(self.poolings) < 1:
            raise ValueError(f"--poolings must be positive, got {self.poolings}")
        if self.interaction not in INTERACTIONS:
            raise ValueError(
                f"--interaction must be one of {', '.join(INTERACTIONS)}, got {self.interaction!r}"
            )
        if self.dcn_layers < 1 or self.dcn_rank < 1:
            raise ValueError(
                f"--dcn-layers and --dcn-rank must be >= 1, got {self.dcn_layers}, {self.dcn_rank}"
            )

    def pooling_text(self) -> str:
        """The bags' sizes as a results header says them."""
        if self.poolings:
            return f"fixed bags of {sum(self.poolings)} ids/sample over the tables"
        return f"pooling ~{self.pooling}"

    def steps_for(self, batch_size: int) -> int:
        """Batches per timed epoch at ``batch_size``."""
        if not self.steps:
            # Small batches are overhead-bound and quick: more steps per epoch.
            return 24 if batch_size <= 1024 else 8
        if len(self.steps) == 1:
            return self.steps[0]
        return self.steps[self.batch_sizes.index(batch_size)]

    def model_spec(self) -> ModelSpec:
        return ModelSpec(
            rows=self.rows,
            dims=tuple(self.dims),
            pooling=self.pooling,
            dense_in=self.dense_in,
            dense_arch=tuple(self.dense_arch),
            over_arch=tuple(self.over_arch),
            poolings=tuple(self.poolings),
            interaction=self.interaction,
            dcn_layers=self.dcn_layers,
            dcn_rank=self.dcn_rank,
        )

    def run_name(self) -> str:
        if self.name:
            return self.name
        if self.preset:
            return self.preset
        if self.link_gbit is not None:
            return f"link-{self.link_gbit:g}gbit"
        return "default"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _element_type(annotation: Any) -> Any:
    """``Tuple[int, ...]`` -> int, ``Optional[float]`` -> float, ``int`` -> int."""
    args = [a for a in typing.get_args(annotation) if a is not Ellipsis and a is not type(None)]
    return args[0] if args else annotation


def _tuple_parser(kind: Any, name: str) -> Any:
    def parse(text: str) -> Tuple[Any, ...]:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        try:
            return tuple(kind(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--{name} takes comma-separated {kind.__name__} values, got {text!r}"
            ) from None

    return parse


# Shown by --help above the options: what a run costs, and a look that costs less.
_DESCRIPTION = """\
QPS of each trec_pipelines variant next to torchrec's same-named class and a
plain training loop, on CPU ranks (launched under torchrun by this command).

How long: the default run takes about 20 minutes on a 2-core machine (every
variant and torchrec's classes, two batch sizes, memory and overhead phases);
--preset pipelining about 6 minutes, --preset dlrm-dcnv2 and dlrm-dcnv2-10gbit
about 6 each.  A quick look (two variants on the
pipelining preset, 3 rounds: a couple of minutes):

  python -m benchmarks --preset pipelining --repeats 3 \\
      --variants TrainPipelineSparseDist,StagedTrainPipeline

make bench runs this command: pass options as make bench BENCH_ARGS="...".

Results go to <out-dir>/<name>/: table.txt, results.json and qps.png (with
--timelines also timelines/, a timeline per variant of ours)."""

_EPILOG = """\
Redraw a results folder's figure from its results.json (nothing is run):

  python -m benchmarks replot benchmarks/results/<run> [--out DIR]

The regime map (short runs over embedding dim x link speed; its own --help):

  python -m benchmarks sweep"""


def _default_text(value: Any) -> str:
    """A field's default as --help shows it (tuples comma-separated, as they are typed)."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _help(name: str, default: Any) -> str:
    """A field's help line, its default appended unless the help already says it."""
    text = _HELP.get(name, "")
    if "(default:" in text:
        return text.replace("%", "%%")
    return f"{text} (default: {_default_text(default)})".replace("%", "%%")


class _Toggle(argparse.BooleanOptionalAction):
    """``--x`` / ``--no-x`` whose help is exactly as written: Python 3.10's action
    appends its own "(default: ...)" to help that already says it."""

    def __init__(self, *args: Any, help: Optional[str] = None, **kwargs: Any) -> None:  # noqa: A002
        super().__init__(*args, help=help, **kwargs)
        self.help = help


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    hints = typing.get_type_hints(BenchConfig)
    for f in fields(BenchConfig):
        flag = "--" + f.name.replace("_", "-")
        annotation = hints[f.name]
        help_text = _help(f.name, f.default)
        origin = typing.get_origin(annotation)
        if annotation is bool:
            parser.add_argument(flag, action=_Toggle, default=f.default, help=help_text)
        elif origin in (tuple, typing.Tuple):
            parser.add_argument(
                flag,
                type=_tuple_parser(_element_type(annotation), f.name.replace("_", "-")),
                default=f.default,
                metavar="A,B,...",
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, type=_element_type(annotation), default=f.default, help=help_text
            )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None) -> BenchConfig:
    """A :class:`BenchConfig` from command-line arguments (errors exit with usage).

    A ``--preset`` becomes the defaults of a second parse, so any option
    given next to it overrides what the preset sets.
    """
    parser = build_parser()
    args = list(argv) if argv is not None else None
    namespace = parser.parse_args(args)
    if namespace.preset:
        if namespace.preset not in PRESETS:
            parser.error(f"--preset must be one of {', '.join(PRESETS)}, got {namespace.preset!r}")
        parser.set_defaults(**PRESETS[namespace.preset])
        namespace = parser.parse_args(args)
    values = {f.name: getattr(namespace, f.name) for f in fields(BenchConfig)}
    try:
        return BenchConfig(**values)
    except ValueError as error:
        parser.error(str(error))
        raise  # unreachable: parser.error exits


def to_argv(config: BenchConfig) -> List[str]:
    """Command-line arguments that parse back to ``config`` (used to relaunch under torchrun)."""
    argv: List[str] = []
    # What parsing starts from: the dataclass defaults, under the preset's values.
    defaults = dataclasses.replace(BenchConfig(), **PRESETS.get(config.preset, {}))
    for f in fields(BenchConfig):
        value = getattr(config, f.name)
        if value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


__all__ = [
    "DLRM_BATCH",
    "DLRM_DCNV2_POOLINGS",
    "PRESETS",
    "BenchConfig",
    "build_parser",
    "parse_args",
    "to_argv",
]
