"""MindSpore's checkpoint files: ``.ckpt`` (protobuf) and safetensors (metadata ``{"format": "ms"}``).

A ``.ckpt`` file is a sequence of serialized ``Checkpoint`` messages (proto2), each holding ``Value``s: a ``tag``
(the parameter's name) and a ``TensorProto`` (``dims``, ``tensor_type`` such as ``"Float32"``, the raw little-endian
``tensor_content``). A tensor larger than ``SLICE_BYTES`` spans several values of the same tag, which follow each
other; a string is stored with type ``"str"``, dims ``[0]``, as UTF-32-LE. With ``crc_check`` the file ends with
``b"crc_num"`` and the CRC-32 of everything before it in 10 big-endian bytes. The message classes are built at run
time from their descriptor (no generated module), in a pool of their own.
"""
from __future__ import annotations

import binascii
import math
from pathlib import Path

import torch

from paratrain.checkpoint.storage import CheckpointError, write_atomic
from paratrain.nn.parameter import Parameter

MINDSPORE_LAYOUT = "mindspore"  # the ``checkpoint_layout`` of a Parameter read from a MindSpore file
SLICE_BYTES = 512 * 2**20
CRC_MARK = b"crc_num"
CRC_BYTES = 10
STRING_TYPE = "str"

TENSOR_TYPES = {"Float32": torch.float32, "Float16": torch.float16, "BFloat16": torch.bfloat16,
                "Float64": torch.float64, "Int8": torch.int8, "Int16": torch.int16, "Int32": torch.int32,
                "Int64": torch.int64, "UInt8": torch.uint8, "UInt16": torch.uint16, "UInt32": torch.uint32,
                "UInt64": torch.uint64, "Bool": torch.bool}
TYPE_NAMES = {dtype: name for name, dtype in TENSOR_TYPES.items()}

_messages = None


def _message_classes():
    """(Checkpoint, TensorProto) message classes, built once from MindSpore's ``checkpoint.proto`` as a descriptor."""
    global _messages
    if _messages is None:
        from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

        field = descriptor_pb2.FieldDescriptorProto
        optional, required, repeated = field.LABEL_OPTIONAL, field.LABEL_REQUIRED, field.LABEL_REPEATED
        file = descriptor_pb2.FileDescriptorProto(name="paratrain_mindspore_checkpoint.proto",
                                                  package="paratrain_mindspore", syntax="proto2")

        def message(name, fields, parent=None):
            proto = (parent.nested_type if parent is not None else file.message_type).add(name=name)
            for number, (field_name, label, kind, type_name, oneof) in enumerate(fields, start=1):
                proto.field.add(name=field_name, number=number, label=label, type=kind, type_name=type_name or None,
                                **({"oneof_index": 0} if oneof else {}))
            return proto

        message("TensorProto", [("dims", repeated, field.TYPE_INT64, None, False),
                                ("tensor_type", required, field.TYPE_STRING, None, False),
                                ("tensor_content", required, field.TYPE_BYTES, None, False)])
        message("MapTensorProto", [("tensor", repeated, field.TYPE_MESSAGE, ".paratrain_mindspore.TensorProto", False)])
        checkpoint = message("Checkpoint", [("value", repeated, field.TYPE_MESSAGE,
                                             ".paratrain_mindspore.Checkpoint.Value", False)])
        value = message("Value", [("tag", required, field.TYPE_STRING, None, False),
                                  ("tensor", optional, field.TYPE_MESSAGE, ".paratrain_mindspore.TensorProto", True),
                                  ("maptensor", optional, field.TYPE_MESSAGE, ".paratrain_mindspore.MapTensorProto",
                                   True)], parent=checkpoint)
        value.oneof_decl.add(name="value")
        pool = descriptor_pool.DescriptorPool()
        pool.Add(file)
        _messages = tuple(message_factory.GetMessageClass(pool.FindMessageTypeByName(f"paratrain_mindspore.{name}"))
                          for name in ("Checkpoint", "TensorProto"))
    return _messages


def mindspore_parameter(name: str, value: torch.Tensor | str) -> Parameter | str:
    """A tensor read from a MindSpore file as a ``Parameter`` named ``name`` marked as in MindSpore's layout."""
    if isinstance(value, str):
        return value
    param = Parameter(value, requires_grad=value.is_floating_point(), name=name)
    param.checkpoint_layout = MINDSPORE_LAYOUT
    return param


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw bytes of ``tensor``'s elements in C order (little-endian, as the machine's)."""
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensor_from_bytes(data: bytes, dims: list[int], tensor_type: str, file: Path, name: str) -> torch.Tensor:
    """The tensor of ``dims`` and MindSpore type ``tensor_type`` held in ``data``; CheckpointError naming ``file``
    and ``name`` where the type is unknown or the bytes do not fill the shape."""
    dtype = TENSOR_TYPES.get(tensor_type)
    if dtype is None:
        raise CheckpointError(f"load_checkpoint: {file}: {name} has type {tensor_type!r}, which paratrain does not "
                              f"read (it reads {', '.join(TENSOR_TYPES)} and strings)")
    needed = math.prod(dims) * dtype.itemsize
    if len(data) != needed:
        raise CheckpointError(f"load_checkpoint: {file} is damaged: {name} holds {len(data)} bytes, its shape "
                              f"{list(dims)} of {tensor_type} needs {needed} (a truncated or altered file)")
    if not data:
        return torch.empty(dims, dtype=dtype, device="cpu")  # a file's tensors are host tensors
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(dims)


def read_ckpt(file: Path, crc_check: bool = False) -> dict[str, Parameter | str]:
    """The tensors (``mindspore_parameter``s) and strings of MindSpore ``.ckpt`` file ``file`` by tag, in file
    order. A trailing CRC is checked with ``crc_check`` (a file without one is refused then). CheckpointError names
    the file and cause."""
    checkpoint_class, _ = _message_classes()
    from google.protobuf.message import DecodeError

    try:
        content = Path(file).read_bytes()
    except OSError as exc:
        raise CheckpointError(f"load_checkpoint: cannot read {file} ({exc.strerror})") from None
    has_crc = content[-CRC_BYTES - len(CRC_MARK):-CRC_BYTES] == CRC_MARK
    if has_crc:
        content, recorded = content[:-CRC_BYTES - len(CRC_MARK)], int.from_bytes(content[-CRC_BYTES:], "big")
        if crc_check and binascii.crc32(content) != recorded:
            raise CheckpointError(f"load_checkpoint: {file} is damaged: its content fails the CRC it records "
                                  f"({binascii.crc32(content)}, {recorded} when written)")
    elif crc_check:
        raise CheckpointError(f"load_checkpoint: {file} records no CRC to check (saved without crc_check): load it "
                              f"with crc_check=False")
    checkpoint = checkpoint_class()
    try:
        checkpoint.ParseFromString(content)
    except DecodeError as exc:
        raise CheckpointError(f"load_checkpoint: {file} is not a readable MindSpore checkpoint: its protobuf "
                              f"content does not parse ({exc}; a truncated or damaged file?)") from None
    if not checkpoint.value and content:
        raise CheckpointError(f"load_checkpoint: {file} is not a MindSpore checkpoint: it holds no tagged value")
    chunks: dict[str, list] = {}
    for value in checkpoint.value:
        if value.WhichOneof("value") != "tensor":
            raise CheckpointError(f"load_checkpoint: {file}: {value.tag} is a MapParameter (MindSpore's hash "
                                  f"table), which paratrain does not read; save it as a tensor")
        chunks.setdefault(value.tag, []).append(value.tensor)
    params: dict[str, torch.Tensor | str] = {}
    for tag, parts in chunks.items():
        data, first = b"".join(p.tensor_content for p in parts), parts[0]
        if first.tensor_type == STRING_TYPE:
            params[tag] = data.decode("utf-32-le").rstrip("\0")
        else:
            dims = [] if list(first.dims) == [0] else list(first.dims)  # MindSpore's scalar
            params[tag] = mindspore_parameter(tag, tensor_from_bytes(data, dims, first.tensor_type, file, tag))
    return params


def _values(items: dict[str, torch.Tensor | str]):
    """The serialized ``Checkpoint`` messages of ``items``, one value each (tensors over SLICE_BYTES in several)."""
    checkpoint_class, _ = _message_classes()
    for name, item in items.items():
        if isinstance(item, str):
            dims, kind, data = [0], STRING_TYPE, item.encode("utf-32-le")
        else:
            dims, kind, data = list(item.shape), TYPE_NAMES[item.dtype], tensor_bytes(item)
        for start in range(0, max(len(data), 1), SLICE_BYTES):
            message = checkpoint_class()
            value = message.value.add(tag=name)
            value.tensor.dims.extend(dims)
            value.tensor.tensor_type, value.tensor.tensor_content = kind, data[start:start + SLICE_BYTES]
            yield message.SerializeToString()


def check_savable(items: dict, file: Path, format: str) -> None:
    """CheckpointError naming the first item of ``items`` that a MindSpore file of ``format`` cannot hold."""
    for name, item in items.items():
        if isinstance(item, str) and format == "ckpt":
            continue
        if not isinstance(item, torch.Tensor) or item.dtype not in TYPE_NAMES:
            what = f"a tensor of {item.dtype}" if isinstance(item, torch.Tensor) else type(item).__name__
            raise CheckpointError(f"save_checkpoint: {file}: {name} is {what}, which a MindSpore {format} file "
                                  f"cannot hold (it holds tensors of {', '.join(map(str, TYPE_NAMES))}"
                                  f"{' and strings' if format == 'ckpt' else ''})")


def write_ckpt(file: Path, items: dict[str, torch.Tensor | str], crc_check: bool = False) -> None:
    """Write ``items`` (name -> tensor or string) to MindSpore ``.ckpt`` file ``file``, atomically; with
    ``crc_check`` a trailing CRC that MindSpore's ``load_checkpoint(crc_check=True)`` checks."""
    check_savable(items, file, "ckpt")

    def write(tmp: Path) -> None:
        crc = 0
        with open(tmp, "wb") as f:
            for message in _values(items):
                f.write(message)
                crc = binascii.crc32(message, crc)
            if crc_check:
                f.write(CRC_MARK + crc.to_bytes(CRC_BYTES, "big"))

    _write(file, write)


def _write(file: Path, writer) -> None:
    """``write_atomic(file, writer)``, a failure (a full disk, no permission) as a CheckpointError naming ``file``."""
    from safetensors import SafetensorError

    try:
        write_atomic(file, writer)
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"save_checkpoint: cannot write {file} ({getattr(exc, 'strerror', None) or exc})") \
            from None


def _safetensors_crc(tensors: dict[str, torch.Tensor]) -> int:
    """MindSpore's CRC of a safetensors file: over each name and its tensor's bytes, in sorted name order."""
    crc = 0
    for name in sorted(tensors):
        crc = binascii.crc32(tensor_bytes(tensors[name]), binascii.crc32(name.encode(), crc))
    return crc


def is_mindspore_safetensors(file: Path) -> bool:
    """Whether safetensors file ``file`` was written by MindSpore (its metadata says ``"format": "ms"``)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            return (f.metadata() or {}).get("format") == "ms"
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"load_checkpoint: {file} is not a readable safetensors file ({exc})") from None


def read_safetensors(file: Path, crc_check: bool = False) -> dict[str, Parameter]:
    """The tensors (``mindspore_parameter``s) of MindSpore safetensors file ``file``; with ``crc_check`` the CRC its
    metadata records is checked (a file without one is refused then). A file saved with MindSpore's
    ``remove_redundancy`` is refused: each rank's holds only part of the tensors."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"load_checkpoint: {file} is not a readable safetensors file ({exc})") from None
    if metadata.get("remove_redundancy") == "True":
        raise CheckpointError(f"load_checkpoint: {file} was saved with remove_redundancy=True: it holds only this "
                              f"rank's share of the data-parallel copies; save it with remove_redundancy=False")
    if crc_check:
        if "crc_num" not in metadata:
            raise CheckpointError(f"load_checkpoint: {file} records no CRC to check (saved without crc_check): "
                                  f"load it with crc_check=False")
        if _safetensors_crc(tensors) != int(metadata["crc_num"]):
            raise CheckpointError(f"load_checkpoint: {file} is damaged: its tensors fail the CRC it records")
    return {name: mindspore_parameter(name, tensor) for name, tensor in tensors.items()}


def write_safetensors(file: Path, items: dict[str, torch.Tensor], crc_check: bool = False) -> None:
    """Write ``items`` to safetensors file ``file`` as MindSpore does (metadata ``{"format": "ms"}``, sorted
    names; with ``crc_check`` the CRC it checks), atomically."""
    from safetensors.torch import save_file

    check_savable(items, file, "safetensors")
    tensors = {name: items[name].detach().cpu().contiguous().clone() for name in sorted(items)}
    metadata = {"format": "ms"} | ({"crc_num": str(_safetensors_crc(tensors))} if crc_check else {})
    _write(file, lambda tmp: save_file(tensors, str(tmp), metadata=metadata))
