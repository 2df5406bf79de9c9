"""Command line: ``python -m embcache demo`` runs the main job."""

from __future__ import annotations

import argparse
import random
import sys

from embcache.allocator import RangeAllocator


def allocator_demo(blocks: int, seed: int) -> int:
    """Fragment an allocator with mixed sizes and show that accounting stays exact."""
    rng = random.Random(seed)
    alloc = RangeAllocator(blocks * 8 * 4096, alignment=4096)
    live: list[int] = []
    failures = 0
    for step in range(blocks * 4):
        if live and rng.random() < 0.45:
            alloc.free(live.pop(rng.randrange(len(live))))
        else:
            offset = alloc.allocate(4096 * rng.randint(1, 16))
            if offset is None:
                failures += 1
            else:
                live.append(offset)
        if step % max(1, blocks // 2) == 0:
            print(
                f"step {step:6d}: {len(live):5d} live, {alloc.free_bytes:10d} bytes free, "
                f"largest free block {alloc.largest_free_block}"
            )
    alloc.check_invariants()
    print(
        f"done: {len(live)} live blocks, {failures} allocations found no fitting block, "
        "invariants hold"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="embcache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run the main job")
    demo.add_argument("--blocks", type=int, default=2000)
    demo.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.blocks <= 0:
        parser.error(f"--blocks must be > 0, got {args.blocks}")
    return allocator_demo(args.blocks, args.seed)


if __name__ == "__main__":
    sys.exit(main())
