@echo off
rem Set up (once) and serve the default model: the Windows `make serve`. Extra arguments go to
rem `megacapybara serve`, e.g.  bats\serve.bat --port 9000 --ctx 32768
setlocal
cd /d "%~dp0\.."
call bats\setup.bat || exit /b 1
.venv\Scripts\python -m orchestrator serve %*
