"""One poisoned host memory for emulated ranks (tests/ptx_emulator.py): named regions, byte
and word access. Shared by tests/test_dispatch_overlap_emulated.py and
tests/test_combine_protocol_emulated.py."""
import torch

POISON = 0x5A


def tobytes(t):
    return bytes(t.contiguous().view(torch.uint8).reshape(-1).tolist())


class Heap:
    """Named regions of one poisoned host memory, 256-byte aligned with poisoned gaps between
    them (a store past a region lands in a gap and shows in ``where``)."""

    def __init__(self):
        self.regions, self.top = {}, 0x1000

    def alloc(self, name, nbytes):
        self.regions[name] = (self.top, int(nbytes))
        self.top += (int(nbytes) + 255) // 256 * 256 + 256
        return self.regions[name][0]

    def make(self):
        self.mem = bytearray([POISON]) * (self.top + 0x1000)
        return self.mem

    def ranges(self):
        """[(start, end)] of every region: the emulator's ``valid`` (loads checked too)."""
        return [(a, a + n) for a, n in self.regions.values()]

    def __getitem__(self, name):
        return self.regions[name][0]

    def put(self, name, data: bytes, at=0):
        a = self.regions[name][0] + at
        self.mem[a:a + len(data)] = data

    def get(self, name, nbytes=None, at=0):
        a, n = self.regions[name]
        a += at
        return bytes(self.mem[a:a + (n if nbytes is None else nbytes)])

    def words(self, name, count, at=0, bits=64):
        raw = self.get(name, count * bits // 8, at)
        return [int.from_bytes(raw[i:i + bits // 8], "little", signed=True)
                for i in range(0, len(raw), bits // 8)]

    def put_words(self, name, values, bits=64, at=0):
        self.put(name, b"".join(int(v).to_bytes(bits // 8, "little", signed=v < 0)
                                for v in values), at)
