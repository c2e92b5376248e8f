"""The cluster test's driver: :func:`spillover.verify.chaos.run_killing_a_worker` against
the master given, printing one JSON line with the outcome (run as a script in a
process of its own, since a process holds one SparkContext).
"""

from __future__ import annotations

import argparse
import json

from spillover.verify.chaos import run_killing_a_worker


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--master", required=True)
    p.add_argument("--workdir", required=True)
    p.add_argument("--checkpoint-dir", default=None)
    args = p.parse_args()
    out = run_killing_a_worker(args.workdir, master=args.master, checkpoint_dir=args.checkpoint_dir)
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
