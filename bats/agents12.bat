@echo off
rem Preset: 12 agents at once on one GPU, each with room for long tool-using conversations.
rem 12 slots share 192k tokens of q8_0 KV; paused agents wait in RAM, in 4 GiB reserved at start
rem (page-locked: pauses never allocate). Extra arguments override.
call "%~dp0serve.bat" --slots 12 --ctx 196608 --cache-type-k q8_0 --cache-type-v q8_0 --flash-attn on --swap-prealloc-mb 4096 %*
