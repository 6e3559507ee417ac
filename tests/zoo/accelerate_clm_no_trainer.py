"""Zoo shape: Hugging Face accelerate's ``run_clm_no_trainer.py`` (huggingface/transformers
examples), written anew at toy size.

Its shape: an ``Accelerator(gradient_accumulation_steps=2)`` (which starts the process group), a
causal LM (a one-layer GPT-2 from a tiny config, nothing downloaded), ``accelerator.prepare`` of the
model, optimizer, evaluation loader and scheduler (``get_scheduler("linear", ...)``), a loop of
micro-batches under ``accelerator.accumulate(model)`` with ``accelerator.backward(loss)``,
``optimizer.step()``, ``lr_scheduler.step()``, ``optimizer.zero_grad()``, the completed steps
counted on ``accelerator.sync_gradients``, and an evaluation every ``EVAL_EVERY`` steps whose
losses are ``accelerator.gather_for_metrics``-ed into a perplexity. Guarded as the README says: one
``guard.steps`` step per optimizer step (its micro-batches inside), the train data through a
``ResumableSampler`` (the Guard's sampler; the train loader is left out of ``prepare``, which would
shard it a second time), the evaluation in ``guard.section``.
"""

from __future__ import annotations

import math
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from _zoo import STEPS, say_step, write_weights_hash  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler  # noqa: E402

import trainguard  # noqa: E402

warnings.filterwarnings("ignore")
ACCUM, BATCH, EVAL_EVERY, SEQ = 2, 4, 20, 16


def blocks(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n, SEQ), generator=torch.Generator().manual_seed(seed))


def main() -> None:
    cfg = trainguard.config_from_env()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM, cpu=True)
    torch.set_num_threads(1)
    trainguard.seed_everything(cfg.run.seed)
    train_ids, eval_ids = blocks(512, 0), blocks(32, 1)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    eval_dataloader = DataLoader([{"input_ids": x, "labels": x} for x in eval_ids], batch_size=8)
    lr_scheduler = get_scheduler("linear", optimizer=optimizer, num_warmup_steps=5, num_training_steps=STEPS)
    model, optimizer, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, eval_dataloader, lr_scheduler
    )
    rank, world = accelerator.process_index, accelerator.num_processes
    sampler = trainguard.ResumableSampler(len(train_ids), rank, world, seed=cfg.run.seed)
    # the prepared optimizer and scheduler are accelerate's wrappers; the Guard takes the torch objects
    # inside them (given the wrappers themselves, it unwraps them: src/trainguard/guard/wrappers.py)
    guard = trainguard.Guard(
        cfg, model=model, optimizer=optimizer.optimizer, scheduler=lr_scheduler.scheduler, sampler=sampler
    )
    completed_steps = 0
    for completed_steps in guard.steps(STEPS):
        model.train()
        total_loss = 0.0
        for _ in range(ACCUM):
            ids = train_ids[sampler.take(BATCH)]
            with accelerator.accumulate(model):
                outputs = model(input_ids=ids, labels=ids)
                loss = outputs.loss
                total_loss += loss.detach().float() / ACCUM
                accelerator.backward(loss)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
        if accelerator.sync_gradients:
            completed_steps += 1
        if completed_steps % EVAL_EVERY == 0:
            with guard.section("eval"):
                model.eval()
                losses = []
                for batch in eval_dataloader:
                    with torch.no_grad():
                        outputs = model(**batch)
                    losses.append(accelerator.gather_for_metrics(outputs.loss.repeat(len(batch["input_ids"]))))
                eval_loss = torch.mean(torch.cat(losses))
                perplexity = math.exp(eval_loss)
            accelerator.print(f"eval at {completed_steps}: perplexity {perplexity:.3f} eval_loss {eval_loss:.4f}")
        guard.step_end(loss=total_loss)
        say_step(rank, completed_steps, STEPS, float(total_loss))
    accelerator.wait_for_everyone()
    write_weights_hash(accelerator.unwrap_model(model), rank)
    accelerator.end_training()


if __name__ == "__main__":
    main()
