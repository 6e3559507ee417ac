"""Zoo shape: PyTorch's word-level language model (``pytorch/examples``,
``word_language_model/main.py``), made data-parallel and guarded as docs/loops.md shows.

Its shape: an LSTM language model (embedding, ``nn.LSTM``, a linear decoder, dropout) trained with
truncated backpropagation through time: the token stream is cut into ``batchify`` columns, each
step takes a ``bptt``-long window (``get_batch``), the hidden state is carried from window to
window and detached (``repackage_hidden``), the gradients are clipped with
``clip_grad_norm_(model.parameters(), clip)``, and the update is written by hand, without a torch
optimizer: ``p.data.add_(p.grad, alpha=-lr)``. Guarded as a new user would after reading
docs/loops.md: DDP over the model, each rank its own columns, the hand update under
``guard.should_step``, the hidden state and the learning rate as ``extra_state`` values.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _zoo import STEPS, say_step, write_weights_hash
from torch.nn.parallel import DistributedDataParallel as DDP

import trainguard

BPTT, BATCH, CLIP = 12, 4, 0.25


class RNNModel(torch.nn.Module):
    def __init__(self, ntoken: int, ninp: int = 32, nhid: int = 32) -> None:
        super().__init__()
        self.drop = torch.nn.Dropout(0.2)
        self.encoder = torch.nn.Embedding(ntoken, ninp)
        self.rnn = torch.nn.LSTM(ninp, nhid, 1)
        self.decoder = torch.nn.Linear(nhid, ntoken)
        self.nhid = nhid

    def forward(self, input: torch.Tensor, hidden: tuple) -> tuple[torch.Tensor, tuple]:
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        return F.log_softmax(self.decoder(self.drop(output)), dim=-1), hidden

    def init_hidden(self, bsz: int) -> tuple:
        return torch.zeros(1, bsz, self.nhid), torch.zeros(1, bsz, self.nhid)


class Carried:
    """What the loop carries from step to step: the LSTM's hidden state and the learning rate."""

    def __init__(self, hidden: tuple, lr: float) -> None:
        self.hidden, self.lr = hidden, lr

    def state_dict(self) -> dict:
        return {"h": self.hidden[0], "c": self.hidden[1], "lr": self.lr}

    def load_state_dict(self, state: dict) -> None:
        self.hidden, self.lr = (state["h"], state["c"]), state["lr"]


def batchify(data: torch.Tensor, bsz: int) -> torch.Tensor:
    nbatch = data.size(0) // bsz
    return data[: nbatch * bsz].view(bsz, -1).t().contiguous()


def get_batch(source: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    seq_len = min(BPTT, len(source) - 1 - i)
    return source[i : i + seq_len], source[i + 1 : i + 1 + seq_len].reshape(-1)


def repackage_hidden(h: tuple) -> tuple:
    return tuple(v.detach() for v in h)


def main() -> None:
    cfg = trainguard.config_from_argv()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    ntokens = 50
    corpus = torch.randint(ntokens, (20000,), generator=torch.Generator().manual_seed(3))
    train_data = batchify(corpus, BATCH * world)[:, rank * BATCH : (rank + 1) * BATCH]  # this rank's columns
    model = RNNModel(ntokens)
    ddp = DDP(model)
    carried = Carried(model.init_hidden(BATCH), lr=2.0)
    guard = trainguard.Guard(cfg, model=ddp, extra_state={"carried": carried})
    windows = (len(train_data) - 1) // BPTT
    for step in guard.steps(STEPS):
        ddp.train()
        data, targets = get_batch(train_data, (step % windows) * BPTT)
        hidden = repackage_hidden(carried.hidden)
        ddp.zero_grad()
        output, hidden = ddp(data, hidden)
        loss = F.nll_loss(output.view(-1, ntokens), targets)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        if guard.should_step(loss, grad_norm):
            for p in ddp.parameters():
                p.data.add_(p.grad, alpha=-carried.lr)
            carried.hidden = repackage_hidden(hidden)
        if (step + 1) % 20 == 0:
            carried.lr /= 4.0  # the example anneals when the validation loss stops improving
        guard.step_end(loss=loss)
        say_step(rank, step + 1, STEPS)
    write_weights_hash(model, rank)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
