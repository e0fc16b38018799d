#!/usr/bin/env python3
"""An independent reader and writer of Megatron-LM's indexed dataset (PREFIX.bin + PREFIX.idx).

Written from the published layout (Megatron-LM's megatron/core/datasets/indexed_dataset.py
describes it), with the standard library's `struct` only, so the Rust tests can check the
Rust code against something that does not share it:

  .idx, little-endian: magic b"MMIDIDX\\x00\\x00" (9 bytes), version u64 = 1, dtype code u8,
  sequence count u64, document count u64 (documents + 1), sequence lengths int32[S],
  sequence byte pointers into .bin int64[S], document indices int64[documents + 1].
  .bin: every sequence's elements, concatenated, in the dtype.

  write PREFIX CODE  reads {"documents": [[sequence, ...], ...]} (a sequence: a list of
                     numbers) from stdin and writes PREFIX.bin and PREFIX.idx
  read PREFIX        prints {"dtype": CODE, "documents": [[sequence, ...], ...]}
"""
import json
import struct
import sys

MAGIC = b"MMIDIDX\x00\x00"
# Megatron-LM's DType codes and the struct letter of each element type.
FORMATS = {1: "B", 2: "b", 3: "h", 4: "i", 5: "q", 6: "d", 7: "f", 8: "H"}


def write(prefix, code, documents):
    fmt = FORMATS[code]
    size = struct.calcsize("<" + fmt)
    lengths, pointers, doc_indices = [], [], [0]
    offset = 0
    with open(prefix + ".bin", "wb") as bin_file:
        for document in documents:
            for sequence in document:
                bin_file.write(struct.pack("<%d%s" % (len(sequence), fmt), *sequence))
                lengths.append(len(sequence))
                pointers.append(offset)
                offset += len(sequence) * size
            doc_indices.append(len(lengths))
    with open(prefix + ".idx", "wb") as idx:
        idx.write(MAGIC)
        idx.write(struct.pack("<Q", 1))
        idx.write(struct.pack("<B", code))
        idx.write(struct.pack("<Q", len(lengths)))
        idx.write(struct.pack("<Q", len(doc_indices)))
        idx.write(struct.pack("<%di" % len(lengths), *lengths))
        idx.write(struct.pack("<%dq" % len(pointers), *pointers))
        idx.write(struct.pack("<%dq" % len(doc_indices), *doc_indices))


def read(prefix):
    with open(prefix + ".idx", "rb") as f:
        idx = f.read()
    if idx[:9] != MAGIC:
        raise SystemExit("%s.idx: bad magic %r" % (prefix, idx[:9]))
    (version,) = struct.unpack_from("<Q", idx, 9)
    if version != 1:
        raise SystemExit("%s.idx: version %d" % (prefix, version))
    (code,) = struct.unpack_from("<B", idx, 17)
    if code not in FORMATS:
        raise SystemExit("%s.idx: dtype code %d" % (prefix, code))
    sequences, doc_count = struct.unpack_from("<QQ", idx, 18)
    at = 34
    lengths = struct.unpack_from("<%di" % sequences, idx, at)
    at += 4 * sequences
    pointers = struct.unpack_from("<%dq" % sequences, idx, at)
    at += 8 * sequences
    doc_indices = struct.unpack_from("<%dq" % doc_count, idx, at)
    at += 8 * doc_count
    if at != len(idx):
        raise SystemExit("%s.idx: %d bytes, the header says %d" % (prefix, len(idx), at))
    with open(prefix + ".bin", "rb") as f:
        data = f.read()
    fmt = FORMATS[code]
    seqs = [
        list(struct.unpack_from("<%d%s" % (n, fmt), data, p))
        for n, p in zip(lengths, pointers)
    ]
    documents = [
        seqs[doc_indices[k]:doc_indices[k + 1]] for k in range(len(doc_indices) - 1)
    ]
    return {"dtype": code, "documents": documents}


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "write":
        write(sys.argv[2], int(sys.argv[3]), json.load(sys.stdin)["documents"])
    elif len(sys.argv) == 3 and sys.argv[1] == "read":
        json.dump(read(sys.argv[2]), sys.stdout)
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
