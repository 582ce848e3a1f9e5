#!/usr/bin/env sh
# Preset: one huge context, about 1M tokens: YaRN x4 over Qwen3.8 27B's 262,144 and 4-bit KV.
# Needs a GPU with room for it (about 19 GB of q4_0 KV at 1M tokens, plus the weights).
exec "$(dirname "$0")/serve.sh" --slots 1 --ctx 1048576 --yarn-factor 4 --cache-type-k q4_0 --cache-type-v q4_0 --flash-attn on --batch 2048 --chunk 2048 "$@"
