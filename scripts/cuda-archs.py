#!/usr/bin/env python3
"""Lists the GPU code inside a binary built with `--features cuda`, and checks it covers the
architectures asked for. No CUDA tools needed: it reads the ELF's `.nv_fatbin` section (the
fatbinaries nvcc embeds for compiled kernels: SASS per sm_XX, PTX per compute_XX) and the PTX
modules candle and ferrite embed as text (`.target sm_XX`).

  scripts/cuda-archs.py BINARY [--sass 80,90] [--ptx 90] [--text-ptx 80] [--entry NAME ...]

exits 1 naming what is missing.
"""
import argparse
import re
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50


def sections(data):
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    heads = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab = heads[shstrndx][4]

    def name(off):
        end = data.index(b"\0", strtab + off)
        return data[strtab + off:end].decode()

    return {name(h[0]): (h[4], h[5]) for h in heads}


def fatbin_entries(data, off, size):
    """(kind, arch) of every entry: kind 1 is PTX (compute_arch), 2 is SASS (sm_arch)."""
    out = []
    p = off
    while p + 16 <= off + size:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8  # fatbinaries are 8-byte aligned
            continue
        q = p + hsz
        while q < p + hsz + fsz:
            kind, _ev, ehsz, psz, _c, _u, _mi, _ma, arch = struct.unpack_from("<HHIQIIHHI", data, q)
            out.append((kind, arch))
            q += ehsz + psz
        p += hsz + fsz
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary")
    ap.add_argument("--sass", default="", help="sm_XX that must have SASS, e.g. 80,90")
    ap.add_argument("--ptx", default="", help="compute_XX that must have fatbin PTX")
    ap.add_argument("--text-ptx", default="", help="targets the embedded PTX text must use")
    ap.add_argument("--entry", action="append", default=[], help="a kernel that must be there")
    a = ap.parse_args()
    data = open(a.binary, "rb").read()
    secs = sections(data)
    entries = fatbin_entries(data, *secs[".nv_fatbin"]) if ".nv_fatbin" in secs else []
    sass = sorted({arch for kind, arch in entries if kind == 2})
    ptx = sorted({arch for kind, arch in entries if kind == 1})
    text = sorted({int(t) for t in re.findall(rb"\.target sm_(\d+)", data)})
    print(f"{a.binary}: fatbin SASS sm_{sass}, fatbin PTX compute_{ptx} "
          f"({len(entries)} entries); PTX text modules for {text}")
    missing = []
    for want, have, what in ((a.sass, sass, "SASS sm_"), (a.ptx, ptx, "PTX compute_"),
                             (a.text_ptx, text, "PTX text .target sm_")):
        missing += [what + w for w in filter(None, want.split(",")) if int(w) not in have]
    for e in a.entry:
        if not re.search(rb"\.entry " + re.escape(e.encode()) + rb"\(", data):
            missing.append(f"kernel {e}")
    if missing:
        print("missing: " + ", ".join(missing), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
