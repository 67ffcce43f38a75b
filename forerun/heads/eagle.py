"""An EAGLE head: one decoder layer that drafts at the target's feature level.

The target's feature f_t (its final hidden state at position t, the LM head's input) and the
embedding of the token at t+1 go in; the layer predicts f_{t+1}, and the draft vocabulary's
projection of that prediction scores the token at t+2. Drafting runs the head on its own
predictions: (embed(d_1), f̂_{t+1}) gives f̂_{t+2} and d_2, and so on, with a small KV cache of its
own. Features the target really computed replace the predictions as soon as the target verifies.

    x = fc_embed(embed(x_{t+1})) + fc_feature(f_t)         # EAGLE's fc over the concatenation, in two parts
    x = x + attn(norm(x));  x = x + mlp(norm(x))           # a Llama-family layer, rope at position t
    f̂_{t+1} = x;  logits = proj(f̂_{t+1})                   # proj: the target's LM head rows, trainable

Training (`forward_train`) runs whole sequences with causal attention; drafting (`forward`) runs
new rows against the head's cache with an explicit mask (a tree's rows see their ancestors only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forerun.models.decoder import DecoderConfig, Rope, apply_rope
from forerun.models.norm import RMSNorm


class EagleCache:
    """Keys and values of the head's one layer: [KVH, max_len, D] each, filled up to `length`."""

    def __init__(self, kv_heads: int, head_dim: int, max_len: int, device: torch.device) -> None:
        self.k = torch.zeros(kv_heads, max_len, head_dim, device=device)
        self.v = torch.zeros(kv_heads, max_len, head_dim, device=device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.k.shape[1]


class EagleHead(nn.Module):
    def __init__(self, cfg: DecoderConfig, intermediate_size: int, vocab: torch.Tensor) -> None:
        """cfg: the target's; vocab [N]: the token id of each projection row."""
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.fc_embed = nn.Linear(h, h, bias=False)
        self.fc_feature = nn.Linear(h, h, bias=True)
        self.input_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.q = nn.Linear(h, cfg.num_heads * d, bias=cfg.attention_bias)
        self.k = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.v = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.attention_bias)
        self.o = nn.Linear(cfg.num_heads * d, h, bias=False)
        self.post_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate = nn.Linear(h, intermediate_size, bias=False)
        self.up = nn.Linear(h, intermediate_size, bias=False)
        self.down = nn.Linear(intermediate_size, h, bias=False)
        self.proj = nn.Linear(h, len(vocab), bias=False)
        self.register_buffer("vocab", vocab.clone())
        for norm in (self.input_norm, self.post_norm):
            norm.weight.requires_grad_(True)
        self._rope = Rope(d, cfg.rope_theta, cfg.rope_freq_factors)
        self._init_weights(h)

    def _init_weights(self, hidden: int) -> None:
        # Small random layer weights; fc starts as "take the feature" so an untrained head's first
        # guess is what the target's LM head says of the last feature.
        for lin in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down, self.fc_embed):
            nn.init.normal_(lin.weight, std=0.02 / hidden**0.5 * 8)
            if lin.bias is not None:
                nn.init.zeros_(lin.bias)
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.down.weight)
        with torch.no_grad():
            self.fc_feature.weight.copy_(torch.eye(hidden))
            self.fc_feature.bias.zero_()

    def init_projection(self, weight: torch.Tensor) -> None:
        """weight [N, hidden]: the target's LM head rows of the draft vocabulary."""
        with torch.no_grad():
            self.proj.weight.copy_(weight)

    def new_cache(self, max_len: int, device: torch.device) -> EagleCache:
        return EagleCache(self.num_kv_heads, self.head_dim, max_len, device)

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """x [B, T, h], positions [B, T] -> q [B, H, T, D], k, v [B, KVH, T, D] (rope applied)."""
        b, t, _ = x.shape
        d = self.head_dim
        cos, sin = self._rope.tables(positions, x.dtype)  # [B, T, 1, D]
        q = apply_rope(self.q(x).view(b, t, self.num_heads, d), cos, sin).transpose(1, 2)
        k = apply_rope(self.k(x).view(b, t, self.num_kv_heads, d), cos, sin).transpose(1, 2)
        v = self.v(x).view(b, t, self.num_kv_heads, d).transpose(1, 2)
        return q, k, v

    def _block(self, x: torch.Tensor, attend) -> torch.Tensor:
        """The layer around an attention function attend(normed x) -> [B, T, h]."""
        x = x + attend(self.input_norm(x))
        y = self.post_norm(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))

    def forward_train(self, embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """embeds, features [B, T, h] (row t: embed(x_{t+1}) and f_t) -> predicted f_{t+1} [B, T, h]."""
        b, t, h = features.shape
        positions = torch.arange(t, device=features.device)[None].expand(b, t)

        def attend(x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(x, positions)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # [B, H, T, D]
            return self.o(out.transpose(1, 2).reshape(b, t, -1))

        return self._block(self.fc_embed(embeds) + self.fc_feature(features), attend)

    def forward_unrolled(self, embeds: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """The head drafting `depth` steps from every position of one sequence at once, as it drafts
        (teacher-forced on the tokens): embeds, features [T, h] (row t: embed(x_{t+1}) and the true f_t)
        -> `depth` tensors [T, h]. Step j's row s is f̂_{s+1} at depth j of the chain that starts from
        the true feature at t = s - j + 1: it reads (embed(x_{s+1}), step j-1's f̂_s) (step 1: the true
        f_s) and sees what the drafter's row sees, the true rows up to t and the chain's own rows of
        steps 2..j (one each, at t+1..s). Step 1 is `forward_train`. Rows s < j - 1 have no such
        chain (they start before the text) and hold nothing meaningful.

        This is training for the test the head faces (HASS, EAGLE-3): from the second step on it is
        fed its own features, and every step's keys are the ones drafting would have."""
        t = features.shape[0]
        positions = torch.arange(t, device=features.device)[None]  # [1, T]: also the key columns
        rows, cols = positions.T, positions
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        outs: list[torch.Tensor] = []
        x_embed = self.fc_embed(embeds)
        for j in range(1, depth + 1):
            feed = features if j == 1 else torch.cat([features[:1], outs[-1][:-1]])  # row s: step j-1's f̂_s
            # Visible keys of step i's rows: step 1 up to the chain's start, then one row per later step.
            mask = torch.cat([cols <= rows - j + 1] + [cols == rows - j + i for i in range(2, j + 1)], dim=1)

            def attend(x: torch.Tensor, mask: torch.Tensor = mask) -> torch.Tensor:
                q, k, v = self._qkv(x, positions)
                keys.append(k)
                values.append(v)
                out = F.scaled_dot_product_attention(
                    q, torch.cat(keys, dim=2), torch.cat(values, dim=2), attn_mask=mask[None, None], enable_gqa=True
                )  # [1, H, T, D]
                return self.o(out.transpose(1, 2).reshape(1, t, -1))

            outs.append(self._block((x_embed + self.fc_feature(feed))[None], attend)[0])
        return outs

    @torch.inference_mode()
    def forward(
        self,
        embeds: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        cache: EagleCache,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """New rows against the cache: embeds, features [T, h], positions [T]; their keys and values
        go to slots [cache.length, cache.length + T). visible: bool [T, cache.length + T], what each
        row sees (None: causal). Returns the predicted features [T, h]; the cache grows by T."""
        t = features.shape[0]
        start, stop = cache.length, cache.length + t
        if stop > cache.capacity:
            raise ValueError(f"the head's cache holds {cache.capacity} slots; {stop} asked")

        def attend(x: torch.Tensor) -> torch.Tensor:
            q, k, v = self._qkv(x, positions[None])
            cache.k[:, start:stop], cache.v[:, start:stop] = k[0], v[0]
            mask = visible
            if mask is None:
                mask = (
                    torch.arange(stop, device=x.device)[None, :] <= torch.arange(start, stop, device=x.device)[:, None]
                )
            out = F.scaled_dot_product_attention(
                q, cache.k[None, :, :stop], cache.v[None, :, :stop], attn_mask=mask[None, None], enable_gqa=True
            )  # [1, H, T, D]
            return self.o(out.transpose(1, 2).reshape(1, t, -1))

        out = self._block((self.fc_embed(embeds) + self.fc_feature(features))[None], attend)[0]
        cache.length = stop
        return out

    def logits(self, predicted: torch.Tensor) -> torch.Tensor:
        """predicted features [..., h] -> logits over the draft vocabulary [..., N]."""
        return self.proj(predicted)
