#!/usr/bin/env sh
# Preset: "lossless": Q8_0 weights and f16 KV, for when quality matters more than room.
exec "$(dirname "$0")/serve.sh" --model qwen3.8-27b-mc-q8_0 --cache-type-k f16 --cache-type-v f16 "$@"
