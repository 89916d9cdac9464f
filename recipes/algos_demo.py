"""A toy RL step with molt-algos alone: two prompts, four samples each, GRPO advantages,
train/rollout IS correction, a PPO loss over a tiny linear policy, one gradient step.

Run: python recipes/algos_demo.py   (needs only molt-algos; the real quickstart is `molt-train quickstart`)
"""

import torch

from molt_algos import (
    AdvantageBatch,
    AdvantageConfig,
    LossConfig,
    aggregate,
    compute_advantages,
    importance_correction,
    token_logprobs_and_entropy,
)
from molt_algos.losses import POLICY_LOSSES

torch.manual_seed(0)
VOCAB, HIDDEN, LENGTH = 32, 16, 6
GROUPS, SAMPLES = 2, 4
rows = GROUPS * SAMPLES

# A "policy": fixed hidden states per token and a trainable LM head.
hidden = torch.randn(rows, LENGTH, HIDDEN)
lm_head = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.1)
tokens = torch.randint(0, VOCAB, (rows, LENGTH))
action_mask = torch.ones(rows, LENGTH, dtype=torch.bool)
action_mask[:, :2] = False  # the prompt

batch = AdvantageBatch(
    rewards=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0]),
    action_mask=action_mask,
    group_ids=torch.arange(GROUPS).repeat_interleave(SAMPLES),
    rollout_ids=torch.arange(rows),
)
advantages = compute_advantages(batch, AdvantageConfig(estimator="grpo"))
print("GRPO advantage per sample:", [round(v, 3) for v in advantages.advantages[:, -1].tolist()])

with torch.no_grad():
    old_logprobs, _ = token_logprobs_and_entropy(hidden, lm_head, tokens, temperature=1.0)
rollout_logprobs = old_logprobs + 0.05 * torch.randn_like(old_logprobs)  # engine/trainer mismatch
is_settings = AdvantageConfig(is_correction_level="token", is_correction_mode="trunc")
correction = importance_correction(old_logprobs, rollout_logprobs, action_mask, is_settings)

optimizer = torch.optim.SGD([lm_head], lr=0.5)
logprobs, entropy = token_logprobs_and_entropy(hidden, lm_head, tokens, temperature=1.0)
loss = POLICY_LOSSES["ppo"](
    logprobs, old_logprobs, advantages.advantages, correction.mask, LossConfig()
)
policy_loss = aggregate(loss.per_token * correction.weights, correction.mask, "token-mean")
policy_loss.backward()
optimizer.step()

with torch.no_grad():
    new_logprobs, _ = token_logprobs_and_entropy(hidden, lm_head, tokens)
moved = ((new_logprobs - old_logprobs) * action_mask).sum(-1) / action_mask.sum(-1)
print(
    f"policy loss {policy_loss.item():+.4f}, entropy {aggregate(entropy, action_mask).item():.3f}"
)
print("metrics:", {**advantages.metrics, **correction.metrics, **loss.metrics})
print("mean log-prob change per sample (up for positive advantage):")
for row in range(rows):
    print(
        f"  sample {row}: reward {batch.rewards[row].item():.0f}  change {moved[row].item():+.4f}"
    )
