@echo off
rem Set up (once) and run the lint and the tests: the Windows `make test`.
setlocal
cd /d "%~dp0\.."
call bats\setup.bat || exit /b 1
.venv\Scripts\python -m ruff check . || exit /b 1
.venv\Scripts\python -m ruff format --check . || exit /b 1
.venv\Scripts\python -m pytest %*
