"""What a rank sees: its environment and torch's thread counts (in its main thread and in a thread
started later). `python -m rank_env DIR` writes it to DIR/<RANK>.json; test_launchers.py compares
torchrun's ranks with forked ones."""

import json
import os
import sys
import threading


def seen() -> dict:
    import torch

    later = []
    thread = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return {"env": dict(os.environ), "threads": torch.get_num_threads(), "threads_later": later[0],
            "interop_threads": torch.get_num_interop_threads()}


def main():
    with open(os.path.join(sys.argv[1], f"{os.environ.get('RANK', 0)}.json"), "w") as f:
        json.dump(seen(), f)


if __name__ == "__main__":
    main()
