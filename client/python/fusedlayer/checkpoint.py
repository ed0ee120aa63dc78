"""fusedlayer.import_checkpoint: a DeepSeek-V4 / V4.1 checkpoint folder -> a weight-set manifest.

The same import as ``fusedctl import-checkpoint`` (client/lib/checkpoint_import.cc; docs/weights.md
"Importing a checkpoint"): the same sets, tensor references, hyper-parameters, head tensors, notes
and errors (with the same gRPC codes), so either tool's manifest loads the same sets; the tests
import the same synthetic folders with both and compare the manifests. Needs no server: it reads
``config.json``, ``model.safetensors.index.json``, the headers of the shards it names and the three
small ``hc_head`` tensors.

    r = fusedlayer.import_checkpoint("/models/DeepSeek-V4-Flash", output="v4.json", layers="0-3",
                                     prefix="v4-flash")
    client.load_weights(r.manifest_path)
"""

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import grpc
import numpy as np

from . import errors
from .weights import _SafetensorsFile, _reject_duplicates, _to_fp32, write_safetensors

__all__ = ["CheckpointImport", "import_checkpoint", "parse_layer_range"]


@dataclass(frozen=True)
class _Dialect:
    name: str
    layer_prefix: str
    hc_attn: Tuple[str, str, str]  # fn, base, scale
    attn_norm: str
    hc_ffn: Tuple[str, str, str]
    ffn_norm: str
    q_norm: str
    kv_norm: str
    wq_b: str
    wq_b_scale: str
    norm: str
    hc_head: Tuple[str, str, str]


# The two spellings of client/lib/checkpoint_import.cc, entry for entry.
_DEEPSEEK = _Dialect("deepseek", "layers.", ("hc_attn_fn", "hc_attn_base", "hc_attn_scale"), "attn_norm.weight",
                     ("hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale"), "ffn_norm.weight", "attn.q_norm.weight",
                     "attn.kv_norm.weight", "attn.wq_b.weight", "attn.wq_b.scale", "norm.weight",
                     ("hc_head_fn", "hc_head_base", "hc_head_scale"))
_HUGGINGFACE = _Dialect("huggingface", "model.layers.", ("attn_hc.fn", "attn_hc.base", "attn_hc.scale"),
                        "input_layernorm.weight", ("ffn_hc.fn", "ffn_hc.base", "ffn_hc.scale"),
                        "post_attention_layernorm.weight", "self_attn.q_a_norm.weight", "self_attn.kv_norm.weight",
                        "self_attn.q_b_proj.weight", "self_attn.q_b_proj.weight_scale_inv", "model.norm.weight",
                        ("model.hc_head.hc_fn", "model.hc_head.hc_base", "model.hc_head.hc_scale"))
_KNOWN_PREFIXES = ("layers.", "embed.", "head.", "norm.", "hc_head_", "mtp.", "model.", "lm_head.")
_SEAM_MARKERS = ("hc_head", "hc_attn", "hc_ffn", "attn_hc", "ffn_hc")
_SWA_NORM = re.compile(r"^(model\.)?layers\.[0-9]+\.(self_)?attn\.[A-Za-z_]*(q|kv)[A-Za-z_]*norm[A-Za-z_]*\.[A-Za-z_]+$")
_SET_NAME_CHARS = re.compile(r"^[A-Za-z0-9._/-]+$")


@dataclass
class CheckpointImport:
    """What import_checkpoint wrote (fusedctl prints the same)."""
    manifest_path: str
    head_tensors_path: str          # "" when no head set was written
    dialect: str                    # "deepseek" or "huggingface"
    set_names: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)


def _invalid(message: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, message)


def _not_found(message: str) -> errors.NotFound:
    return errors.NotFound(grpc.StatusCode.NOT_FOUND, message)


def parse_layer_range(text: str) -> Tuple[int, int]:
    """"A-B" (0 <= A <= B) or "A", decimal digits only -> (first, last), as fusedctl's --layers."""
    bad = _invalid(f"--layers={text}: expected A-B (0 <= A <= B) or A, decimal")

    def number(t: str) -> int:
        if not t or len(t) > 9 or not t.isdigit() or not t.isascii():
            raise bad
        return int(t)
    if "-" not in text:
        first = number(text)
        return first, first
    a, _, b = text.partition("-")
    first, last = number(a), number(b)
    if last < first:
        raise bad
    return first, last


def _read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise _not_found(f"cannot open {path}") from None
    except OSError as e:
        raise errors.Internal(grpc.StatusCode.INTERNAL, f"cannot read {path}: {e.strerror}") from None
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except (ValueError, errors.InvalidArgument) as e:
        raise _invalid(f"{path}: {getattr(e, 'message', e)}") from None


@dataclass
class _Config:
    hidden: int
    hc_mult: int
    layers: int
    q_rank: int
    head_dim: int
    sinkhorn_iters: int
    rms_norm_eps: float
    hc_eps: float
    ue8m0: bool
    weight_block_size: List[int]


def _parse_config(j: Any, where: str) -> _Config:
    if not isinstance(j, dict):
        raise _invalid(f"{where}: must be a JSON object")

    def get_int(key: str) -> int:
        if key not in j:
            raise _invalid(f"{where}: missing \"{key}\"")
        v = j[key]
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise _invalid(f"{where}: \"{key}\" must be a positive integer")
        return v

    def get_number(key: str) -> float:
        if key not in j:
            raise _invalid(f"{where}: missing \"{key}\"")
        v = j[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _invalid(f"{where}: \"{key}\" must be a number")
        return float(v)
    ints = {k: get_int(k) for k in ("hidden_size", "hc_mult", "num_hidden_layers", "q_lora_rank", "head_dim",
                                    "hc_sinkhorn_iters")}
    numbers = {k: get_number(k) for k in ("rms_norm_eps", "hc_eps")}
    ue8m0, block = False, []
    if "quantization_config" in j:
        q = j["quantization_config"]
        if not isinstance(q, dict):
            raise _invalid(f"{where}: \"quantization_config\" must be an object")
        if "scale_fmt" in q:
            if not isinstance(q["scale_fmt"], str):
                raise _invalid(f"{where}: quantization_config.scale_fmt must be a string")
            ue8m0 = q["scale_fmt"] == "ue8m0"
        if "weight_block_size" in q:
            b = q["weight_block_size"]
            if not isinstance(b, list) or any(isinstance(e, bool) or not isinstance(e, int) for e in b):
                raise _invalid(f"{where}: quantization_config.weight_block_size must be an array of integers")
            block = list(b)
    return _Config(hidden=ints["hidden_size"], hc_mult=ints["hc_mult"], layers=ints["num_hidden_layers"],
                   q_rank=ints["q_lora_rank"], head_dim=ints["head_dim"], sinkhorn_iters=ints["hc_sinkhorn_iters"],
                   rms_norm_eps=numbers["rms_norm_eps"], hc_eps=numbers["hc_eps"], ue8m0=ue8m0,
                   weight_block_size=block)


def _shape(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


class _Checkpoint:
    def __init__(self, folder: str, weight_map: Dict[str, str]) -> None:
        self.folder = folder
        self.weight_map = weight_map
        self._shards: Dict[str, _SafetensorsFile] = {}

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def find(self, name: str, role: str) -> Tuple[_SafetensorsFile, Dict[str, Any]]:
        if name not in self.weight_map:
            raise _not_found(f"tensor \"{name}\" ({role}) is not in model.safetensors.index.json")
        shard = self.weight_map[name]
        if shard not in self._shards:
            try:
                self._shards[shard] = _SafetensorsFile(os.path.join(self.folder, shard))
            except errors.FusedLayerError as e:
                raise type(e)(e.code, f"tensor \"{name}\" ({role}): {e.message}") from None
        f = self._shards[shard]
        entry = f.header.get(name)
        if name == "__metadata__" or not isinstance(entry, dict):
            raise _not_found(f"model.safetensors.index.json places \"{name}\" in {shard}: {f.path}: no tensor "
                             f"\"{name}\"")
        return f, entry


def _dialect(ckpt: _Checkpoint, layer: int) -> _Dialect:
    ds_name = f"{_DEEPSEEK.layer_prefix}{layer}.{_DEEPSEEK.hc_attn[0]}"
    hf_name = f"{_HUGGINGFACE.layer_prefix}{layer}.{_HUGGINGFACE.hc_attn[0]}"
    ds, hf = ckpt.has(ds_name), ckpt.has(hf_name)
    if ds and hf:
        raise _invalid(f"model.safetensors.index.json mixes both dialects: it has \"{ds_name}\" and \"{hf_name}\"")
    if ds:
        return _DEEPSEEK
    if hf:
        return _HUGGINGFACE
    for name in sorted(ckpt.weight_map):
        if not name.startswith(_KNOWN_PREFIXES):
            raise _invalid(f"unknown checkpoint layout: cannot place tensor \"{name}\" (in {ckpt.weight_map[name]}); "
                           "the importer reads DeepSeek's names (layers.{i}.hc_attn_fn, ...) and Hugging Face's "
                           "(model.layers.{i}.attn_hc.fn, ...)")
    raise _invalid(f"unknown checkpoint layout: model.safetensors.index.json has neither \"{ds_name}\" nor "
                   f"\"{hf_name}\" (a DeepSeek-V4 / V4.1 checkpoint has one of them for every layer)")


def _layer_name(d: _Dialect, layer: int, suffix: str) -> str:
    return f"{d.layer_prefix}{layer}.{suffix}"


def _reject_unrecognised(ckpt: _Checkpoint, d: _Dialect, layers: int) -> None:
    known: Set[str] = {d.norm, *d.hc_head}
    for layer in range(layers):
        for t in (*d.hc_attn, d.attn_norm, *d.hc_ffn, d.ffn_norm, d.q_norm, d.kv_norm, d.wq_b, d.wq_b_scale):
            known.add(_layer_name(d, layer, t))
    unknown = [f"\"{n}\"" for n in sorted(ckpt.weight_map)
               if not n.startswith("mtp.") and n not in known
               and (any(m in n for m in _SEAM_MARKERS) or _SWA_NORM.match(n))]
    if unknown:
        shown = ", ".join(unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        raise _invalid(f"model.safetensors.index.json has {len(unknown)} tensor(s) that look like mHC / SWA "
                       f"parameters but are not in the {d.name} names the importer reads: {shown} (a spelling of "
                       "another layout? docs/weights.md lists the names read)")


def _set_name(prefix: str, name: str) -> str:
    if not prefix:
        return name
    if not _SET_NAME_CHARS.match(prefix) or prefix.startswith("/") or prefix.endswith("/"):
        raise _invalid(f"--prefix={prefix}: set names take [A-Za-z0-9._/-] only, and the prefix must not start or "
                       "end with '/'")
    return f"{prefix}/{name}"


def _layers_arg(layers: Union[None, str, int, Tuple[int, int], range]) -> Optional[Tuple[int, int]]:
    if layers is None:
        return None
    if isinstance(layers, str):
        return parse_layer_range(layers)
    if isinstance(layers, bool):
        raise TypeError("layers takes \"A-B\", an int, a (first, last) pair or a range")
    if isinstance(layers, int):
        first = last = layers
    elif isinstance(layers, range):
        if layers.step != 1 or len(layers) == 0:
            raise _invalid(f"layers={layers!r}: expected a non-empty range with step 1")
        first, last = layers.start, layers.stop - 1
    else:
        first, last = layers
    if first < 0 or last < first:
        raise _invalid(f"layers=({first}, {last}): expected 0 <= first <= last")
    return first, last


def import_checkpoint(folder: Union[str, "os.PathLike[str]"], output: Union[str, "os.PathLike[str]"] = "manifest.json",
                      layers: Union[None, str, int, Tuple[int, int], range] = None,
                      prefix: str = "") -> CheckpointImport:
    """Writes a manifest (and OUTPUT.head.safetensors with the head set) for a DeepSeek-V4 / V4.1
    checkpoint folder, exactly as ``fusedctl import-checkpoint FOLDER --output=OUTPUT [--layers=A-B]
    [--prefix=P]`` does.

    layers: "A-B" / "A" (fusedctl's --layers), an int, a (first, last) pair (inclusive) or a range;
    None: every layer, with the head set. prefix: set names P/L0/attn, ..., P/head (two models on one
    server). Errors are the package's classes with fusedctl's codes: NotFound (folder, config,
    index, a tensor), InvalidArgument (config keys, shapes, layout, unrecognised mHC / SWA tensors).
    """
    d_path = os.fspath(folder)
    if not os.path.isdir(d_path):
        raise _not_found(f"checkpoint folder {d_path} does not exist or is not a folder")
    config_path = os.path.join(d_path, "config.json")
    c = _parse_config(_read_json(config_path), config_path)
    index_path = os.path.join(d_path, "model.safetensors.index.json")
    index = _read_json(index_path)
    if not isinstance(index, dict) or not isinstance(index.get("weight_map"), dict):
        raise _invalid(f"{index_path}: needs a \"weight_map\" object")
    weight_map: Dict[str, str] = {}
    for name, shard in index["weight_map"].items():
        if not isinstance(shard, str):
            raise _invalid(f"{index_path}: weight_map[\"{name}\"] must be a shard file name")
        weight_map[name] = shard
    ckpt = _Checkpoint(d_path, weight_map)

    first, last = 0, c.layers - 1
    asked = _layers_arg(layers)
    if asked is not None:
        if asked[1] >= c.layers:
            raise _invalid(f"--layers={asked[0]}-{asked[1]}: the model has {c.layers} layers (0-{c.layers - 1})")
        first, last = asked
    d = _dialect(ckpt, first)
    _reject_unrecognised(ckpt, d, c.layers)
    _set_name(prefix, "head")  # checks the prefix before anything is written

    n, C, Q, D = c.hc_mult, c.hidden, c.q_rank, c.head_dim
    M, K = n * (n + 2), n * C
    manifest_path = os.path.abspath(os.fspath(output))
    manifest_dir = os.path.dirname(manifest_path)
    if not os.path.isdir(manifest_dir):
        raise _not_found(f"--output={os.fspath(output)}: folder {manifest_dir} does not exist")
    result = CheckpointImport(manifest_path=manifest_path, head_tensors_path="", dialect=d.name)

    def relative(path: str) -> str:
        rel = os.path.relpath(os.path.abspath(path), manifest_dir)
        return rel if rel else os.path.abspath(path)

    def add(tensors: Dict[str, Any], set_tensor: str, name: str, shape: Sequence[int], role: str) -> None:
        f, entry = ckpt.find(name, role)
        if shape and list(entry["shape"]) != list(shape):
            raise _invalid(f"tensor \"{name}\" ({role}) has shape {_shape(entry['shape'])}; config.json implies "
                           f"{_shape(shape)}")
        tensors[set_tensor] = {"file": relative(f.path), "tensor": name}

    def mhc_config() -> Dict[str, Any]:
        return {"hc_mult": n, "hidden": C, "hc_norm_eps": c.rms_norm_eps, "norm_eps": c.rms_norm_eps,
                "hc_pre_eps": c.hc_eps, "sinkhorn_eps": c.hc_eps, "sinkhorn_iters": c.sinkhorn_iters}

    blocks_128 = not c.weight_block_size or c.weight_block_size == [128, 128]
    wq_b_note_given = False
    sets: List[Dict[str, Any]] = []
    for layer in range(first, last + 1):
        attn_name = _set_name(prefix, f"L{layer}/attn")
        swa: Dict[str, Any] = {"q_rank": Q, "head_dim": D, "eps": c.rms_norm_eps}
        if c.ue8m0:
            swa["scale_format"] = "ue8m0"
        tensors: Dict[str, Any] = {}
        role = f"layer {layer} attention seam"
        add(tensors, "mhc.fn", _layer_name(d, layer, d.hc_attn[0]), [M, K], role)
        add(tensors, "mhc.scale", _layer_name(d, layer, d.hc_attn[2]), [3], role)
        add(tensors, "mhc.base", _layer_name(d, layer, d.hc_attn[1]), [M], role)
        add(tensors, "mhc.norm_weight", _layer_name(d, layer, d.attn_norm), [C], role)
        add(tensors, "swa.q_norm", _layer_name(d, layer, d.q_norm), [Q], role)
        add(tensors, "swa.kv_norm", _layer_name(d, layer, d.kv_norm), [D], role)
        wq_b = _layer_name(d, layer, d.wq_b)
        if ckpt.has(wq_b):
            _, wi = ckpt.find(wq_b, role)
            w_dtype, w_shape = wi.get("dtype"), [int(x) for x in wi["shape"]]
            skip = ""
            if w_dtype not in ("F8_E4M3", "F8_E4M3FNUZ"):
                skip = f"dtype {w_dtype}, the service's wq_b is FP8"
            elif not blocks_128:
                skip = (f"weight_block_size [{', '.join(str(b) for b in c.weight_block_size)}], the service's wq_b "
                        "has 128x128 blocks")
            elif len(w_shape) != 2 or w_shape[1] != Q or w_shape[0] <= 0 or w_shape[0] % 128 != 0:
                raise _invalid(f"tensor \"{wq_b}\" ({role}) has shape {_shape(w_shape)}; expected [N, {Q}] with N a "
                               "positive multiple of 128")
            if not skip:
                if w_dtype == "F8_E4M3FNUZ":
                    swa["fp8_format"] = "e4m3fnuz"
                add(tensors, "swa.wq_b", wq_b, [], role)
                add(tensors, "swa.wq_b_scale", _layer_name(d, layer, d.wq_b_scale), [w_shape[0] // 128, Q // 128],
                    role)
            elif not wq_b_note_given:
                result.notes.append(f"wq_b left out of the L{{i}}/attn sets ({skip}): \"{wq_b}\"")
                wq_b_note_given = True
        elif not wq_b_note_given:
            result.notes.append(f"no \"{wq_b}\" in the index: the L{{i}}/attn sets have no wq_b")
            wq_b_note_given = True
        sets.append({"name": attn_name, "mhc": mhc_config(), "swa": swa, "tensors": tensors})
        result.set_names.append(attn_name)

        ffn_name = _set_name(prefix, f"L{layer}/ffn")
        ffn: Dict[str, Any] = {}
        ffn_role = f"layer {layer} FFN seam"
        add(ffn, "mhc.fn", _layer_name(d, layer, d.hc_ffn[0]), [M, K], ffn_role)
        add(ffn, "mhc.scale", _layer_name(d, layer, d.hc_ffn[2]), [3], ffn_role)
        add(ffn, "mhc.base", _layer_name(d, layer, d.hc_ffn[1]), [M], ffn_role)
        add(ffn, "mhc.norm_weight", _layer_name(d, layer, d.ffn_norm), [C], ffn_role)
        sets.append({"name": ffn_name, "mhc": mhc_config(), "tensors": ffn})
        result.set_names.append(ffn_name)

    if last == c.layers - 1:
        present = sum(ckpt.has(t) for t in d.hc_head)
        if present not in (0, 3):
            missing = next(t for t in d.hc_head if not ckpt.has(t))
            raise _not_found(f"tensor \"{missing}\" (head) is not in model.safetensors.index.json, though the other "
                             "hc_head tensors are")
        fn = np.zeros(M * K, np.float32)
        scale = np.zeros(3, np.float32)
        base = np.zeros(M, np.float32)
        if present == 3:
            for name, shape, target in ((d.hc_head[0], [n, K], fn), (d.hc_head[1], [n], base),
                                        (d.hc_head[2], [1], scale)):
                f, entry = ckpt.find(name, "head")
                if list(entry["shape"]) != shape:
                    raise _invalid(f"tensor \"{name}\" (head) has shape {_shape(entry['shape'])}; config.json "
                                   f"implies {_shape(shape)}")
                st_dtype, raw = f.read(name)
                values = _to_fp32(st_dtype, raw, f"{f.path}: tensor \"{name}\"").ravel()
                target[:values.size] = values  # fn: the pre rows 0..n-1; base: the pre bases; scale: alpha_pre
        else:
            result.notes.append("no hc_head tensors (V4.1): the head set's mixes parameters are zeros, unused by "
                                "the head stage")
        stem, ext = os.path.splitext(manifest_path)
        head_path = (stem if ext else manifest_path) + ".head.safetensors"
        write_safetensors(head_path, {"head.fn": ("F32", fn.reshape(M, K)), "head.scale": ("F32", scale),
                                      "head.base": ("F32", base)},
                          metadata={"producer": "fusedlayer.import_checkpoint",
                                    "source": "hc_head_fn/hc_head_scale/hc_head_base in the pre rows, zeros elsewhere"
                                    if present == 3 else "zeros (the model has no hc_head)"})
        result.head_tensors_path = head_path
        head_file = relative(head_path)
        tensors = {"mhc.fn": {"file": head_file, "tensor": "head.fn"},
                   "mhc.scale": {"file": head_file, "tensor": "head.scale"},
                   "mhc.base": {"file": head_file, "tensor": "head.base"}}
        add(tensors, "mhc.norm_weight", d.norm, [C], "head")
        sets.append({"name": _set_name(prefix, "head"), "mhc": mhc_config(), "tensors": tensors})
        result.set_names.append(_set_name(prefix, "head"))
    else:
        result.notes.append(f"no head set: --layers stops before the last layer ({c.layers - 1})")

    try:
        with open(manifest_path, "w") as out:
            out.write(json.dumps({"weight_sets": sets}, indent=2) + "\n")
    except OSError as e:
        raise errors.PermissionDenied(grpc.StatusCode.PERMISSION_DENIED,
                                      f"cannot write {manifest_path}: {e.strerror}") from None
    return result
