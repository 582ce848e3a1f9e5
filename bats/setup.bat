@echo off
rem MegaCapybara setup on Windows: the same steps as `make setup`.
rem Needs Python >= 3.11, CMake, Visual Studio Build Tools (C++), and Git for Windows (for patch.exe).
rem GPU users: set MC_BACKEND=cuda (and MC_CUDA_ARCH, default 90;120) with the CUDA toolkit installed,
rem and set TORCH_SPEC to a CUDA build of torch 2.13.0.
setlocal
cd /d "%~dp0\.."
if "%TORCH_SPEC%"=="" set TORCH_SPEC=torch==2.13.0
if not exist .venv\Scripts\python.exe python -m venv .venv || exit /b 1
.venv\Scripts\python -m pip install --quiet "%TORCH_SPEC%" numpy || exit /b 1
.venv\Scripts\python ggml-patches\build.py --python .venv\Scripts\python.exe || exit /b 1
.venv\Scripts\python -m pip install --quiet -e .[dev] || exit /b 1
