"""ROUNDS (env, default 3) runs of a timing script's `measure` step, each in a fresh process (the
spread between processes is larger than within one), one line per round: the script's last
output line (its JSON) or its error's last line. Used by soft_forward_sizes.py and topk_shapes.py
through main()."""
import os
import subprocess
import sys


def run_rounds(script: str, header: str) -> None:
    print(header)
    for rnd in range(int(os.environ.get("ROUNDS", "3"))):
        r = subprocess.run([sys.executable, script, "measure"], capture_output=True, text=True)
        err = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        print(f"r{rnd}: " + (r.stdout.strip().splitlines()[-1] if r.returncode == 0 else "error: " + err), flush=True)


def main(script: str, header: str, measure) -> None:
    """A timing script's entry point: `script measure` runs one round in this process, plain
    `script` runs the rounds, each in a fresh process."""
    if sys.argv[1:2] == ["measure"]:
        measure()
    else:
        run_rounds(script, header)
