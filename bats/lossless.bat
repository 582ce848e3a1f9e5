@echo off
rem Preset: "lossless": Q8_0 weights and f16 KV, for when quality matters more than room.
call "%~dp0serve.bat" --model qwen3.8-27b-mc-q8_0 --cache-type-k f16 --cache-type-v f16 %*
