"""``weave serve``: run the daemon - the model, its sessions and the HTTP API on the Unix socket.

Everything heavy (the daemon, numba, FastAPI, uvicorn) is imported inside the command, so registering
it costs nothing to the client commands.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from functools import partial
from pathlib import Path
from typing import Annotated, NoReturn

import typer
from weaved.cli.fmt import printable

HELP = (
    "Run the Weave daemon: load the model, recover the sessions of earlier runs and serve the HTTP API "
    "(OpenAI-compatible, plus Weave's sessions and SLA tags) on a Unix socket.\n\n"
    "The socket is $WEAVE_SOCKET, else $XDG_RUNTIME_DIR/weave/weave.sock, else ~/.weave/weave.sock; "
    "only your user can use it (mode 0600). --listen adds a TCP listener, which needs an API key "
    "(--api-key or $WEAVE_API_KEY) that clients send as 'Authorization: Bearer KEY'.\n\n"
    "Without --model, the default model (SmolLM2-135M-Instruct) is used; a model in another "
    "quantization is converted to the shared Q4_0 format once, into the cache. With peers in the profile, or "
    "--federation-port, it also serves the control plane its peers check (TCP, 127.0.0.1 unless the profile's "
    "federation bind says otherwise, every request carrying the federation token). SIGTERM or Ctrl-C stop "
    "the daemon cleanly: the step in flight finishes, its tokens are committed, the socket is removed.\n\n"
    "The first start on a machine (or after an upgrade) compiles the kernels, about a minute, and then starts "
    "again in the same process to serve them from the cache without the compiler's memory."
)
RESTARTED_ENV = "WEAVE_SERVE_RESTARTED"  # set across that one restart, so that it happens at most once
LOCK_FD_ENV = "WEAVE_SERVE_LOCK_FD"  # the socket lock's descriptor, held across that restart


# the model and profile options of the commands that load a model in-process (serve, calibrate)
ModelOpt = Annotated[Path | None, typer.Option("--model", "-m", help="GGUF model (default: SmolLM2-135M-Instruct).",
                                               show_default=False)]
ProfileOpt = Annotated[str | None, typer.Option("--profile", "-p", help="Shipped profile name or a TOML file "
                                                "(default: detected from the hardware).", show_default=False)]


def say_line(message: str, err: bool = False) -> None:
    typer.echo(printable(f"weave: {message}"), err=err)


def _fail(message: str, code: int = 1) -> typer.Exit:
    """``weave: error: ...``; exit 2 for bad usage (the arguments), 1 when serving fails."""
    typer.echo(printable(f"weave: error: {message}"), err=True)
    return typer.Exit(code)


def _log_line(message: str) -> None:
    typer.echo(printable(f"{time.strftime('%H:%M:%S')} {message}"))


class _ConvertProgress:
    """Prints a model conversion's progress in steps of 10 % (``err``: on stderr)."""

    def __init__(self, err: bool = False) -> None:
        self._shown = -1
        self._err = err

    def __call__(self, done: int, total: int, name: str) -> None:
        if total <= 0:
            return
        tenth = done * 10 // total
        if tenth > self._shown:
            self._shown = tenth
            say_line(f"converting the model: {tenth * 10}%", self._err)


class Terminated(KeyboardInterrupt):
    """SIGTERM during the load: raised in the main thread so that what is under way stops as Ctrl-C stops
    it - a conversion's temporary file removed, locks let go - and ``weave`` exits 143."""


def _terminate(signum, frame) -> None:
    raise Terminated()


def stop_on_sigterm() -> None:
    """SIGTERM raises ``Terminated`` from here on (the server installs its own handlers once it serves)."""
    signal.signal(signal.SIGTERM, _terminate)


def _restart_fresh(daemon, lock_fd: int) -> NoReturn:
    """Start ``weave serve`` again in this process (same pid, arguments and output) once its load has
    compiled kernels: compiling leaves LLVM's modules resident for the life of the process (hundreds
    of MB), while the new image loads the same kernels from numba's disk cache
    (``weaved.daemon.warmup``).  Nothing is served before: the socket is not bound yet."""
    import psutil

    resident = psutil.Process().memory_info().rss
    say_line(f"compiled the kernels in {daemon.compiled.seconds:.0f} s; starting again to serve them from the "
         f"cache without the compiler's memory ({resident / 1e6:.0f} MB resident now)")
    from weaved.daemon.data_lock import INHERITED_ENV as DATA_LOCK_ENV

    data_fd = daemon.hand_over_data_dir()
    daemon.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os.environ[RESTARTED_ENV] = "1"
    os.set_inheritable(lock_fd, True)  # the socket's lock stays held across the exec: clients keep waiting
    os.environ[LOCK_FD_ENV] = str(lock_fd)
    if data_fd is not None:  # and the data directory's: no other daemon takes it in between
        os.set_inheritable(data_fd, True)
        os.environ[DATA_LOCK_ENV] = str(data_fd)
    os.execv(sys.executable, [sys.executable, "-m", "weaved.cli", *sys.argv[1:]])


def _inherited_lock() -> int | None:
    """The socket's lock this process held before ``_restart_fresh`` exec'd it again, if so."""
    fd = os.environ.pop(LOCK_FD_ENV, None)
    if fd is None or not fd.isdigit():
        return None
    try:
        os.fstat(int(fd))
    except OSError:
        return None
    os.set_inheritable(int(fd), False)
    return int(fd)


def resolve_model(model: Path | None, err: bool = False) -> Path:
    """The model to serve: the default one, or ``model`` converted to the shared format if need be
    (``err``: its progress on stderr, for a command whose stdout is JSON)."""
    from weaved.model.default import default_model_path, ensure_native

    say = partial(say_line, err=err)
    if model is None:
        return default_model_path(_ConvertProgress(err), log=say)
    if model.is_dir():
        raise _fail(f"{model} is a directory: --model takes a GGUF file", 2)
    if not model.is_file():
        raise _fail(f"model file not found: {model}", 2)
    try:
        return ensure_native(model, _ConvertProgress(err), log=say)
    except ValueError as e:  # (not a GGUF Weave runs: a bad --model, as a missing one is)
        raise _fail(str(e), 2) from None


def register(app: typer.Typer) -> None:
    """Add ``serve`` to ``app``."""

    @app.command("serve", help=HELP)
    def serve(
        ctx: typer.Context,
        model: ModelOpt = None,
        profile: ProfileOpt = None,
        socket: Annotated[Path | None, typer.Option("--socket", help="Unix socket path.",
                                                    show_default=False)] = None,
        listen: Annotated[str | None, typer.Option("--listen", metavar="HOST:PORT",
                                                   help="Also listen on TCP (needs an API key).")] = None,
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="WEAVE_API_KEY", show_default=False,
                                                    help="Key TCP clients must send.")] = None,
        data_dir: Annotated[str | None, typer.Option("--data-dir", metavar="<path>",
                                                     help="Where sessions' KV files and the journal live "
                                                          "(default: the profile's).",
                                                     show_default=False)] = None,
        chat_template: Annotated[Path | None, typer.Option(
            "--chat-template", show_default=False,
            help="A Jinja chat template file to use instead of the model's own (a base model has none).")] = None,
        federation_port: Annotated[int | None, typer.Option(
            "--federation-port", min=0, max=65535, show_default=False,
            help="Serve the control plane for peers on this TCP port (0: any free port; default: the "
                 "profile's federation port, 7411 when it names peers). Needs the profile's federation "
                 "token.")] = None,
    ) -> None:
        import asyncio

        from weaved.cli.socket_path import default_socket_path

        from weaved.api.sockets import ServerError, bind_tcp, check_socket_free, hold_socket_lock, parse_listen
        from weaved.config.load import load_profile
        from weaved.config.tables import ProfileError
        from weaved.federation.service import FederationError, federation_listen

        if socket is None and "://" in os.environ.get("WEAVE_SOCKET", ""):  # (the clients' URL form)
            raise _fail(f"WEAVE_SOCKET is {os.environ['WEAVE_SOCKET']!r}, a URL: the daemon serves a Unix socket "
                        f"(give its path, or --socket; for TCP use --listen HOST:PORT)", 2)
        path = (socket or default_socket_path()).expanduser().absolute()
        try:  # everything that can be refused is refused before the model loads
            source = ctx.get_parameter_source("api_key")
            if listen is None and source is not None and source.name == "COMMANDLINE":
                # (the Unix socket's access is its file mode: a key would be ignored; one exported in
                # WEAVE_API_KEY for the clients is fine)
                raise _fail("--api-key is for the TCP listener: give --listen HOST:PORT with it", 2)
            if listen is not None:  # (the address first: a key would not make a bad one usable)
                try:
                    address = parse_listen(listen)
                except ServerError as e:
                    raise _fail(str(e), 2) from None
                if not api_key:
                    raise _fail("--listen needs an API key (--api-key or WEAVE_API_KEY)", 2)
                try:  # an address in use, or a host that does not resolve, is found now, not after the load
                    bind_tcp(*address).close()
                except ServerError as e:
                    raise _fail(str(e)) from None
            try:
                prof = load_profile(profile)
            except ProfileError as e:  # the --profile given: bad usage, as a missing --model is
                raise _fail(str(e), 2) from None
            federation = federation_listen(prof, federation_port)
        except (ServerError, FederationError) as e:
            raise _fail(str(e)) from None
        for note in prof.notes:
            say_line(note)
        if federation is None and prof.federation.token:
            say_line("note: the profile's [federation] table sets a token, but neither a port nor peers: the "
                 "control plane is not served (set its port, or pass --federation-port)")
        template = None
        if chat_template is not None:
            from weaved.model.chat_template import ChatTemplate

            try:
                template = chat_template.read_text()
                if not template.strip():  # (else the model's own, or none, would be used without a word)
                    raise ValueError("the file is empty")
                ChatTemplate(template).check()
            except OSError as e:
                raise _fail(f"cannot read the chat template {chat_template}: {e.strerror or e}", 2) from None
            except ValueError as e:  # (a syntax error: every chat request would be refused)
                raise _fail(f"{chat_template}: {e}", 2) from None
        if data_dir is not None and not data_dir.strip():  # (an empty $VAR: not the current directory)
            raise _fail("--data-dir is empty: name a directory, or leave the option out for the profile's", 2)
        try:  # (after the arguments' own checks: a bad one leaves no socket directory made)
            check_socket_free(path)
        except ServerError as e:
            raise _fail(str(e)) from None
        try:  # held from here: a client that finds no socket yet waits for this daemon instead of failing
            lock_fd = _inherited_lock()
            if lock_fd is None:
                lock_fd = hold_socket_lock(path)
        except ServerError as e:
            raise _fail(str(e)) from None
        stop_on_sigterm()  # (until the server's own handlers: a load stopped runs its cleanups, as Ctrl-C does)
        try:  # until the server owns the lock (it lets go of it when it stops), a failure lets go of it here
            from weaved.api.server import Server  # (most of a second: after the lock, which clients wait on)

            model_path = resolve_model(model)
            from weaved.daemon.core import Daemon
            from weaved.errors import SettingRefused, WeaveError

            logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s", datefmt="%H:%M:%S")
            started = time.monotonic()
            data = None if data_dir is None else Path(data_dir).expanduser()  # (as --socket and the profile's)
            daemon = Daemon(prof, model_path, data_dir=data, log_fn=_log_line, federation=federation,
                            chat_template=template)
            restarted = os.environ.pop(RESTARTED_ENV, None) is not None
            try:
                daemon.load(progress=say_line)
            except WeaveError as e:  # (a setting this host cannot honour: bad usage, as a bad option is)
                raise _fail(e.message, 2 if isinstance(e, SettingRefused) else 1) from None
            if daemon.compiled.kernels and not restarted:
                _restart_fresh(daemon, lock_fd)
            server = Server(daemon, path, listen=listen, api_key=api_key, log=_log_line, federation=federation,
                            lock_fd=lock_fd)
        except BaseException:
            os.close(lock_fd)
            raise

        def ready(where: str) -> None:
            say_line(f"serving {daemon.model_name} with profile {prof.name!r}, "
                 f"loaded in {time.monotonic() - started:.1f} s")
            say_line(f"ready on {where}")

        try:
            asyncio.run(server.serve(on_ready=ready))
        except ServerError as e:
            raise _fail(str(e)) from None
        say_line("stopped")
        if daemon.waiting_groups:  # a thread woken inside the interpreter's teardown would abort the process
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
