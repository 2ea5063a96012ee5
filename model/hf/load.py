"""Load a local HF checkpoint directory (``config.json`` + safetensors) into a :class:`MoETransformer`.

Order of work, so that a broken directory fails before anything large is built:

1. ``config.json`` -> :class:`ModelConfig` (:mod:`model.hf.config_map`);
2. the weight files (``model.safetensors``, or the shards ``model.safetensors.index.json`` lists)
   and their headers -> a plan: every HF tensor mapped to a mindmoe parameter (or a row of a
   stacked expert parameter), every parameter covered, every shape and dtype checked. All problems
   are reported together;
3. the model is built with its weights deferred (:mod:`model.deferred_init`: shapes and dtypes, no
   values drawn, nothing allocated) and the tensors are streamed in, one at a time, in file order,
   each straight into its parameter's storage in that parameter's dtype (:mod:`model.hf.param_stream`).
   With expert parallelism a process reads and holds only its experts' rows.

Memory: the parameters once, as they arrive, plus at most one tensor being converted (none when
the file's dtype is the parameter's); the stacked expert parameters whose rows are still arriving
are part of the model's bytes already.
"""

import json
from collections import defaultdict
from pathlib import Path
from typing import Optional

import numpy as np

from mindmoe.model.hf.config_map import HFCheckpointError, ImportedConfig, apply_overrides, read_hf_config
from mindmoe.model.hf.param_stream import ParamStreamer
from mindmoe.model.hf.safetensors_io import INDEX_FILE, READABLE_DTYPES, SINGLE_FILE, read_header, read_tensor
from mindmoe.model.hf.weights import MTP_SHARED_COPIES, NameMap, hf_layer_index, is_stacked_expert
from mindmoe.model.lora import is_adapter
from mindmoe.model.moe_config import moe_policy
from mindmoe.model.param_count import parameter_shapes

CONFIG_FILE = "config.json"
# Listing every one of 10,000 missing expert rows helps nobody; each kind of problem is cut here.
MAX_LINES_PER_PROBLEM = 20


def read_pretrained_config(path, overrides: dict = None, max_seq_len: int = 0) -> ImportedConfig:
    """``config.json`` of a HF directory -> :class:`ImportedConfig` with ``overrides`` applied."""
    directory = _directory(path)
    config_path = directory / CONFIG_FILE
    if not config_path.is_file():
        raise HFCheckpointError(
            f"{directory}: no {CONFIG_FILE}; a HF checkpoint directory needs config.json, "
            "the *.safetensors weights and the tokenizer files"
        )
    try:
        hf = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFCheckpointError(f"{config_path}: not valid JSON ({err})") from None
    imported = read_hf_config(hf, str(config_path), max_seq_len)
    if overrides:
        imported.model_config = apply_overrides(imported, overrides, str(config_path))
    return imported


def load_hf_pretrained(
    path,
    overrides: dict = None,
    max_seq_len: int = 0,
    cell_reuse: bool = False,
    lora=None,
    lora_seed: int = 0,
    expert_dispatcher=None,
    moe=None,
    dsa=None,
):
    """``(ModelConfig, MoETransformer with the HF weights, notes)`` from a local HF directory.

    ``overrides``: ``model.*`` settings the user gave (see :func:`model.hf.config_map.apply_overrides`);
    ``max_seq_len``: the longest sequence that will be run (checked against sliding windows);
    ``cell_reuse``: see :class:`model.transformer.MoETransformer`; ``lora``: a :class:`model.lora.LoraConfig`
    whose adapters the model is built with (targets matched on this architecture's HF names, every
    ``lora_A`` drawn from ``lora_seed``); the HF weights fill the frozen base. ``moe``: the run's
    :class:`model.moe_config.MoEConfig` (default: the defaults, ``auto`` dispatch resolving to dropless); ``dsa``:
    the run's :class:`model.dsa_config.DSATrainingConfig` (default: stage sparse).
    """
    # MindSpore code, imported only when needed: the config readers of this package must not pull it in.
    from mindmoe.model.deferred_init import checkpoint_weights
    from mindmoe.model.lora.plan import plan_adapters
    from mindmoe.model.transformer import MoETransformer

    imported = read_pretrained_config(path, overrides, max_seq_len)
    plan = plan_hf_weights(path, imported)
    adapters = None if lora is None else plan_adapters(imported.model_config, lora, lora_seed, imported.model_type)
    moe = moe_policy(moe).resolved(trained_weights=True)
    if moe.dropless:
        imported.notes.append(
            "MoE layers use moe.dispatch=dropless (capacity dropping would change the pretrained model's logits)"
        )
    with checkpoint_weights():  # no weight the checkpoint provides is drawn or allocated before it is read
        model = MoETransformer(
            imported.model_config,
            cell_reuse=cell_reuse,
            lora=adapters,
            expert_dispatcher=expert_dispatcher,
            moe=moe,
            dsa=dsa,
        )
    held = None if expert_dispatcher is None else expert_dispatcher.held_experts(imported.model_config.num_experts)
    notes = imported.notes + load_hf_weights(model, plan, held)
    return imported.model_config, model, notes


class WeightPlan:
    """Validated mapping of a directory's tensors onto a model's parameters."""

    def __init__(self, imported: ImportedConfig, shapes: dict, assignments: list, notes: list, copies=()):
        self.imported = imported
        self.shapes = shapes  # our name -> shape
        self.assignments = assignments  # (TensorEntry, our name, expert row or None), in file order
        self.notes = notes
        # (TensorEntry, our name): an MTP depth's copy of the shared embedding or head, checked equal after loading.
        self.copies = list(copies)


def weight_files(path) -> list:
    """The safetensors files of a HF directory (the index's shards, or ``model.safetensors``)."""
    directory = _directory(path)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as err:
            raise HFCheckpointError(f"{index_path}: not a safetensors index with a weight_map ({err!r})") from None
        missing = [name for name in files if not (directory / name).is_file()]
        if missing:
            raise HFCheckpointError(
                f"{index_path} lists shards that are not in {directory}: {', '.join(missing)} (incomplete download?)"
            )
        return [directory / name for name in files]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    found = sorted(p.name for p in directory.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    if any(name.endswith(".safetensors") for name in found):
        why = f"has {', '.join(found)} but neither {SINGLE_FILE} nor {INDEX_FILE} to say which are the model"
    elif found:
        why = (
            f"has only {', '.join(found)}; mindmoe reads safetensors and never unpickles checkpoints "
            "(convert them with save_pretrained(safe_serialization=True))"
        )
    else:
        why = f"has no weights ({SINGLE_FILE} or {INDEX_FILE} with its shards)"
    raise HFCheckpointError(f"{directory}: {why}")


class _Planner:
    """The state of one :func:`plan_hf_weights` pass: what was seen, assigned, skipped and wrong."""

    def __init__(self, imported: ImportedConfig):
        self.imported = imported
        self.cfg = imported.model_config
        self.shapes = parameter_shapes(self.cfg, include_buffers=True)
        self.names = NameMap(imported.model_type, self.cfg.num_layers if self.cfg.mtp_layers else None)
        self.copies = []
        self.problems = defaultdict(list)
        self.assignments, self.filled = [], defaultdict(set)
        self.seen, self.skipped_mtp, self.skipped_rope = {}, [], []
        self.notes = []

    def add(self, entry, file: Path) -> None:
        """Assign one tensor of ``file`` to its parameter (or row), or record why it cannot be."""
        where = f"{entry.name} ({file.name})"
        if entry.name in self.seen:
            self.problems["duplicate"].append(f"{where}: also in {self.seen[entry.name]}")
            return
        self.seen[entry.name] = file.name
        if self._skipped(entry.name) or self._shared_copy(entry, file):
            return
        target = self.names.to_ours(entry.name)
        if target is None or target[0] not in self.shapes:
            why = "no mindmoe parameter" if target is None else f"would be {target[0]}, which this config does not have"
            self.problems["unexpected"].append(f"{where}: {entry.dtype}{list(entry.shape)}, {why}")
            return
        our_name, row = target
        shape = self.shapes[our_name]
        expected = shape if row is None else shape[1:]
        if row is not None and row >= shape[0]:
            self.problems["unexpected"].append(f"{where}: expert {row}, but the config has {shape[0]} experts")
        elif entry.dtype not in READABLE_DTYPES:
            self.problems["dtype"].append(f"{where}: dtype {entry.dtype}; readable: {', '.join(READABLE_DTYPES)}")
        elif tuple(entry.shape) != tuple(expected):
            self.problems["shape"].append(
                f"{where}: checkpoint {list(entry.shape)} vs {list(expected)} expected from config.json"
            )
        else:
            self.filled[our_name].add(row)
            self.assignments.append((entry, our_name, row))

    def _skipped(self, name: str) -> bool:
        """Tensors a HF checkpoint may hold that mindmoe does not load (MTP layers, RoPE caches, a tied head)."""
        layer = hf_layer_index(name)
        first_mtp = self.cfg.num_layers + self.cfg.mtp_layers  # the depths model.mtp_layers asks for are loaded
        if layer is not None and first_mtp <= layer < self.cfg.num_layers + self.imported.mtp_layers:
            self.skipped_mtp.append(name)
            return True
        if name.endswith(".rotary_emb.inv_freq"):
            self.skipped_rope.append(name)  # a cache some old checkpoints saved; derived from config.json
            return True
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            self.notes.append("lm_head.weight ignored: tie_word_embeddings=true uses embed_tokens")
            return True
        return False

    def _shared_copy(self, entry, file: Path) -> bool:
        """An MTP depth's copy of the embedding or LM head: DeepSeek-V3 shares both with the main model, so mindmoe
        keeps one parameter each and checks after loading that the copy equals it (:func:`check_shared_copies`)."""
        depth = self.names.mtp_depth(entry.name)
        if depth is None or depth >= self.cfg.mtp_layers:
            return False
        suffix = entry.name.split(f"model.layers.{self.cfg.num_layers + depth}.", 1)[1]
        if suffix not in MTP_SHARED_COPIES:
            return False
        head = "lm_head.weight" if not self.cfg.tie_word_embeddings else "embed_tokens.weight"
        main = "embed_tokens.weight" if suffix == "embed_tokens.weight" else head
        if tuple(entry.shape) != tuple(self.shapes[main]):
            self.problems["shape"].append(
                f"{entry.name} ({file.name}): {list(entry.shape)}, but {main} is {list(self.shapes[main])}"
            )
        else:
            self.copies.append((entry, main))
        return True

    def skip_notes(self) -> list:
        notes = []
        if self.skipped_mtp:
            notes.append(
                f"skipped {len(self.skipped_mtp)} multi-token-prediction tensors of layer(s) "
                f"{sorted({hf_layer_index(n) for n in self.skipped_mtp})} (model.layers.{self.cfg.num_layers}.*): "
                "mindmoe does not train the MTP head"
            )
        if self.skipped_rope:
            notes.append(
                f"skipped {len(self.skipped_rope)} saved rotary_emb.inv_freq caches (recomputed from config.json)"
            )
        return notes


def plan_hf_weights(path, imported: ImportedConfig) -> WeightPlan:
    """Check every tensor of the directory against the config; raise one error listing all problems."""
    files = weight_files(path)
    index_names = _index_names(path)
    planner = _Planner(imported)
    for file in files:
        try:
            entries = read_header(file)
        except ValueError as err:
            raise HFCheckpointError(str(err)) from None
        for entry in entries:
            planner.add(entry, file)
    _check_index(index_names, planner.seen, planner.problems)
    _check_coverage(planner.shapes, planner.filled, planner.names, planner.problems)
    if planner.problems:
        raise HFCheckpointError(_problem_report(path, imported.model_type, planner.problems))
    return WeightPlan(
        imported, planner.shapes, planner.assignments, planner.notes + planner.skip_notes(), planner.copies
    )


def load_hf_weights(model, plan: WeightPlan, held_experts: Optional[range] = None) -> list:
    """Stream the planned tensors into ``model``'s parameters; returns notes.

    Each tensor is read straight into a buffer in its parameter's own dtype (converted per tensor),
    which becomes the parameter's storage: a model built inside
    :func:`model.deferred_init.checkpoint_weights` holds each weight once. ``held_experts``: the expert
    rows this process holds (expert parallelism builds each rank with only its share of every stacked
    expert tensor); the other experts' tensors are never read.
    """
    held = {name: _held_range(name, shape, held_experts) for name, shape in plan.shapes.items()}
    params = {param.name: param for param in model.get_parameters() if not is_adapter(param.name)}
    model_shapes = {name: tuple(param.shape) for name, param in params.items()}
    expected = {name: _held_shape(shape, held[name]) for name, shape in plan.shapes.items()}
    if model_shapes != expected:
        raise HFCheckpointError(
            "the model's parameters differ from those its config implies "
            f"({sorted(set(model_shapes.items()) ^ set(expected.items()))[:5]}); a model built "
            "from another config?"
        )
    by_file = defaultdict(list)
    for assignment in plan.assignments:
        by_file[assignment[0].file].append(assignment)
    streamer = ParamStreamer(params)
    for file, assignments in by_file.items():
        with open(file, "rb") as handle:  # plain reads: no mapping of the file outlives its tensor
            for entry, our_name, row in sorted(assignments, key=lambda a: a[0].offset):
                rows = held[our_name]
                if row is None:
                    streamer.read(handle, entry, our_name, None, 1)
                elif row in rows:
                    streamer.read(handle, entry, our_name, row - rows.start, len(rows))
    from mindmoe.model.deferred_init import finish_deferred  # MindSpore code (see load_hf_pretrained)

    finish_deferred(model)
    check_shared_copies(params, plan.copies)
    return list(plan.notes) + streamer.notes()


def check_shared_copies(params: dict, copies: list) -> None:
    """Each MTP depth's stored embedding / head copy equals the parameter mindmoe shares (one tensor at a time)."""
    from mindmoe.model.linear import numpy_of  # MindSpore code (see load_hf_pretrained)

    for entry, our_name in copies:
        with open(entry.file, "rb") as handle:
            copy = read_tensor(handle, entry)
        ours = numpy_of(params[our_name])
        if not np.array_equal(copy.astype(ours.dtype), ours):
            raise HFCheckpointError(
                f"{entry.name} differs from the main model's {our_name}; mindmoe's MTP layers share the embedding and "
                "LM head (DeepSeek-V3 §2.2), so it cannot hold a separate one: load with model.mtp_layers=0"
            )


def _held_range(name: str, shape, held_experts: Optional[range]) -> Optional[range]:
    """The expert rows of stacked tensor ``name`` this process reads (all without expert parallelism)."""
    if len(shape) != 3 or not is_stacked_expert(name):
        return None
    return held_experts if held_experts is not None else range(shape[0])


def _held_shape(shape, rows: Optional[range]) -> tuple:
    return tuple(shape) if rows is None else (len(rows), *shape[1:])


def _check_index(index_names: dict, seen: dict, problems: dict):
    """Every tensor the index lists is in the shard it names."""
    for name, file_name in index_names.items():
        if name not in seen:
            problems["index"].append(f"{name}: the index puts it in {file_name}, which does not contain it")
        elif seen[name] != file_name:
            problems["index"].append(f"{name}: the index puts it in {file_name}, found in {seen[name]}")


def _check_coverage(shapes: dict, filled: dict, names: NameMap, problems: dict):
    """Every parameter, and every row of a stacked expert parameter, has a tensor (named the HF way)."""
    for our_name, shape in shapes.items():
        rows = filled.get(our_name, set())
        for hf_name, row in names.to_hf(our_name, shape[0] if is_stacked_expert(our_name) else 0):
            if row not in rows:
                problems["missing"].append(f"{hf_name} (for {our_name}{'' if row is None else f'[{row}]'})")


def _directory(path) -> Path:
    directory = Path(path).expanduser()
    if not directory.is_dir():
        raise HFCheckpointError(
            f"{directory}: not a directory (model.pretrained must be a local HF "
            "checkpoint directory; hub ids are not downloaded)"
        )
    return directory


def _index_names(path) -> dict:
    index_path = _directory(path) / INDEX_FILE
    if not index_path.is_file():
        return {}
    weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
    return dict(weight_map)


def _problem_report(path, model_type: str, problems: dict) -> str:
    titles = {
        "missing": "missing (the config needs them, no file has them)",
        "unexpected": "unmapped tensors (not part of a mindmoe model with this config)",
        "shape": "shape mismatches",
        "dtype": "unsupported dtypes",
        "duplicate": "duplicated tensors",
        "index": "index disagrees with the shards",
    }
    lines = [f"{path}: the {model_type} weights do not match config.json:"]
    for kind, title in titles.items():
        items = problems.get(kind)
        if not items:
            continue
        lines.append(f"  {title}: {len(items)}")
        lines += [f"    {item}" for item in items[:MAX_LINES_PER_PROBLEM]]
        if len(items) > MAX_LINES_PER_PROBLEM:
            lines.append(f"    ... and {len(items) - MAX_LINES_PER_PROBLEM} more")
    return "\n".join(lines)
