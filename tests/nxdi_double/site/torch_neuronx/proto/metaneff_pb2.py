"""Contract double of torch_neuronx.proto.metaneff_pb2 (closed source): MetaNeff, MetaTensor and the enums NxD reads.

Used as NxD uses it (docs/nxdi.md section 11; NxD trace/hlo_utils.py read_metaneff / get_input_order @
fbac349): `m = MetaNeff(); m.ParseFromString(data)`, `m.input_tensors[i].type == MetaTensor.Type.INPUT_WEIGHT`,
`checkpoint_key` as BYTES (`.decode()` is the shard key), `shape`, `data_type`.

The protobuf wire format is written by hand so the double needs no protobuf package. MetaTensor's field numbers and
enum values follow the only description in the facts (third-party reverse engineering, docs/nxdi.md section 11:
1 name, 2 shape, 3 data_type, 6 checkpoint_key, 7 type, 8 user_input_key); MetaNeff's own field numbers are not
recorded, so bytes written here round-trip only through this module.
"""

from __future__ import annotations


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _fields(data: bytes):
    """(field number, wire type, value) for every field of a message; value is an int (varint) or bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(data, pos)
        elif wire == 2:
            size, pos = _read_varint(data, pos)
            value, pos = data[pos:pos + size], pos + size
        else:
            raise ValueError(f"metaneff: wire type {wire} of field {field} is not used by MetaNeff")
        yield field, wire, value


class _Repeated(list):
    def __init__(self, cls):
        super().__init__()
        self._cls = cls

    def add(self, **fields):
        item = self._cls(**fields)
        self.append(item)
        return item


class MetaTensor:
    class Type:
        UNDEFINED_TYPE = 0
        USER_INPUT = 1
        INPUT_STATE = 2
        INPUT_WEIGHT = 3

    class DataType:
        FLOAT = 1
        INT32 = 2
        BFLOAT16 = 14
        F8E4M3FN = 15
        F8E5M2 = 16

    def __init__(self, name: bytes = b"", shape=(), data_type: int = 0, checkpoint_key: bytes = b"",
                 type: int = 0, user_input_key: bytes = b""):
        self.name, self.shape, self.data_type = name, list(shape), data_type
        self.checkpoint_key, self.type, self.user_input_key = checkpoint_key, type, user_input_key

    def SerializeToString(self) -> bytes:
        out = bytearray()
        if self.name:
            out += _key(1, 2) + _varint(len(self.name)) + self.name
        if self.shape:
            packed = b"".join(_varint(d) for d in self.shape)
            out += _key(2, 2) + _varint(len(packed)) + packed
        if self.data_type:
            out += _key(3, 0) + _varint(self.data_type)
        if self.checkpoint_key:
            out += _key(6, 2) + _varint(len(self.checkpoint_key)) + self.checkpoint_key
        if self.type:
            out += _key(7, 0) + _varint(self.type)
        if self.user_input_key:
            out += _key(8, 2) + _varint(len(self.user_input_key)) + self.user_input_key
        return bytes(out)

    def ParseFromString(self, data: bytes) -> None:
        self.__init__()
        for field, wire, value in _fields(data):
            if field == 1:
                self.name = bytes(value)
            elif field == 2 and wire == 2:
                pos = 0
                while pos < len(value):
                    dim, pos = _read_varint(value, pos)
                    self.shape.append(dim)
            elif field == 2:
                self.shape.append(value)
            elif field == 3:
                self.data_type = value
            elif field == 6:
                self.checkpoint_key = bytes(value)
            elif field == 7:
                self.type = value
            elif field == 8:
                self.user_input_key = bytes(value)


class MetaNeff:
    def __init__(self):
        self.input_tensors = _Repeated(MetaTensor)
        self.output_tensors = _Repeated(MetaTensor)

    def SerializeToString(self) -> bytes:
        out = bytearray()
        for field, tensors in ((1, self.input_tensors), (2, self.output_tensors)):
            for tensor in tensors:
                body = tensor.SerializeToString()
                out += _key(field, 2) + _varint(len(body)) + body
        return bytes(out)

    def ParseFromString(self, data: bytes) -> None:
        self.__init__()
        for field, wire, value in _fields(data):
            if wire != 2 or field not in (1, 2):
                raise ValueError(f"metaneff: unexpected field {field}")
            tensor = MetaTensor()
            tensor.ParseFromString(bytes(value))
            (self.input_tensors if field == 1 else self.output_tensors).append(tensor)
