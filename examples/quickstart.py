"""Quickstart: turn a Qwen2 into a CausalQwen, check it starts as its Qwen, train a few steps, read a value.

Runs offline in about 7 seconds on a CPU, most of it importing torch and transformers: it builds a tiny random
Qwen2 itself. With a real checkpoint, replace the first lines by
`CausalQwenForCausalLM.from_qwen("path/to/Qwen2.5-0.5B")`.
"""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from causal_qwen import CausalQwenForCausalLM

STEPS = 200


def main() -> None:
    # The model is tiny: one thread is fastest. With several, each small product waits for the others, and on a
    # machine with other work the 200 steps take minutes instead of seconds.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    qwen = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )).eval()
    num_token_id = 250  # a spare row of the vocabulary, as 151,665 is for Qwen2.5
    # A random vocabulary has no digit tokens to start the <NUM> row from: keep Qwen's row of that id.
    model = CausalQwenForCausalLM.from_qwen(qwen, num_token_id=num_token_id, num_row_init="copy")

    ids = torch.randint(0, 200, (4, 12))
    with torch.no_grad():
        same = (model(ids).logits - qwen(ids).logits).abs().max().item()
    print(f"at initialisation, max |loc_S - Qwen logits| = {same:.2e}")

    # A toy task: the token after <NUM> repeats the number, so the model must read the value it is given.
    ids[:, 5] = num_token_id
    ids[:, 6] = num_token_id
    values = torch.zeros(4, 12, dtype=torch.float64)
    values[:, 5] = values[:, 6] = torch.tensor([3.5, 12.0, 150.0, 2048.0], dtype=torch.float64)

    trainable = [p for p in model.parameters() if p.requires_grad]
    print(f"trainable parameters (backbone frozen): {sum(p.numel() for p in trainable):,}")
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    for step in range(STEPS):
        out = model(ids, numeric_values=values, labels=ids)
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == STEPS - 1:
            print(f"step {step:2d}  loss {out.loss.item():9.3f}  cls {out.cls_loss.item():8.3f}  "
                  f"reg {out.reg_loss.item():7.3f}")

    model.eval()
    with torch.no_grad():
        out = model(ids, numeric_values=values)
    median, low, high = model.value_interval(out.loc_Y[:, 5], out.scale_Y[:, 5], coverage=0.9)
    for true, m, lo, hi in zip(values[:, 6].tolist(), median.tolist(), low.tolist(), high.tolist(), strict=False):
        print(f"true {true:8.1f}  predicted median {m:9.2f}  90% interval [{lo:.2f}, {hi:.2f}]")


if __name__ == "__main__":
    main()
