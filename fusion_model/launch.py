"""torchrun, with its rendezvous store bound to ``--master_addr``: ``python -m fusion_model.launch <args>``.

Takes exactly torchrun's arguments (``python -m torch.distributed.run --help``); the train stage starts
this instead of torchrun so a one-node run opens no port beyond 127.0.0.1 (fusion_model/loopback.py).
"""

from __future__ import annotations

from torch.distributed import run

from fusion_model.loopback import bind_stores_to_master_addr

if __name__ == "__main__":
    bind_stores_to_master_addr()
    run.main()
