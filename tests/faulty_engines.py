"""rloo_multinode.py's command line (the trainer's, or `serve`'s) with a fault put in, for test_multinode.py, chosen by
environment variable:

- BAD_ANSWER=case (serve, the hf engine): from its BAD_FROM-th batch on (default 1), each answer is made wrong as
  vllm_standin.BAD_ANSWERS' case makes it: a malicious or broken served engine.
- INIT_FAILS=1 (serve, the hf engine): joining the weight group raises.
- NCCL_BLOCKS_AT=n (the trainer): rank 0's weight group is an NcclWeightGroup, vLLM's NCCL backend's trainer end,
  around a stand-in communicator that broadcasts over the run's gloo group (so the engines receive as ever) and
  whose n-th broadcast never returns, as NCCL's does when a member died mid-sync.
"""

import os
import threading

import conftest  # noqa: F401  (puts the repository on the path)
import rloo_multinode as mn
from vllm_standin import BAD_ANSWERS


class NeverReturns:
    """A communicator as vLLM's PyNcclCommunicator is called (broadcast(tensor, src, stream)), over a gloo group."""

    device = "cpu"

    def __init__(self, group: mn.GlooWeightGroup, blocks_at: int):
        self.group, self.blocks_at, self.calls = group, blocks_at, 0

    def broadcast(self, tensor, src: int, stream=None) -> None:
        self.calls += 1
        if self.calls == self.blocks_at:
            threading.Event().wait()  # never set
        self.group.broadcast(tensor)


def nccl_group_that_blocks(backend, host, port, size, timeout):
    return mn.NcclWeightGroup(NeverReturns(mn.GlooWeightGroup(host, port, 0, size, timeout),
                                           int(os.environ["NCCL_BLOCKS_AT"])))


def bad_generate(generate):
    batches = []

    def generate_badly(self, request: dict) -> dict:
        answer = generate(self, request)
        batches.append(None)
        if len(batches) >= int(os.environ.get("BAD_FROM", 1)):
            BAD_ANSWERS[os.environ["BAD_ANSWER"]](answer, request["stop_token_id"], self.model.config.vocab_size)
        return answer

    return generate_badly


def fails(*args, **kwargs):
    raise RuntimeError("the test's failure")


if __name__ == "__main__":
    if "INIT_FAILS" in os.environ:
        mn.HFEngine.init_weight_transfer_engine = fails
    if "BAD_ANSWER" in os.environ:
        mn.HFEngine.generate = bad_generate(mn.HFEngine.generate)
    if "NCCL_BLOCKS_AT" in os.environ:
        mn.trainer_weight_group = nccl_group_that_blocks
    mn.cli()
