//! `containerd-shim-twig-v2`: started by containerd for runtime
//! `io.containerd.twig.v2` (see the crate's README).

use std::io::Write;
use std::process::ExitCode;

use containerd_shim_protos::protobuf::Message;
use twig_shim::server;

fn init_logging(debug: bool) {
    let level = if debug { "debug" } else { "info" };
    let filter = tracing_subscriber::EnvFilter::try_from_env("TWIG_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    // containerd reads the shim's log from the `log` FIFO in the bundle;
    // never block on it (no reader: log to stderr instead).
    let fifo = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open("log");
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false);
    match fifo {
        Ok(f) => builder.with_writer(std::sync::Mutex::new(f)).init(),
        Err(_) => builder.with_writer(std::io::stderr).init(),
    }
}

use std::os::unix::fs::OpenOptionsExt;

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if args
        .first()
        .is_some_and(|a| a == twig_shim::share_server::SERVE_ARG)
    {
        return match twig_shim::share_server::serve(&args[1..]) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("file-share server: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let flags = match containerd_shim::parse(&args) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{}: {e}", server::RUNTIME_ID);
            return ExitCode::FAILURE;
        }
    };
    if flags.version {
        println!("{} {}", server::RUNTIME_ID, env!("CARGO_PKG_VERSION"));
        return ExitCode::SUCCESS;
    }
    init_logging(flags.debug);
    let result = match flags.action.as_str() {
        "start" => server::start(&flags).and_then(|address| {
            let mut out = std::io::stdout();
            out.write_all(address.as_bytes())
                .and_then(|()| out.flush())
                .map_err(|e| twig_shim::Error::io("writing the address", e))
        }),
        "delete" => server::delete(&flags).and_then(|resp| {
            let bytes = resp
                .write_to_bytes()
                .map_err(|e| twig_shim::Error::Internal(format!("encoding: {e}")))?;
            std::io::stdout()
                .write_all(&bytes)
                .map_err(|e| twig_shim::Error::io("writing the delete response", e))
        }),
        "" => match tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt.block_on(server::serve(flags)),
            Err(e) => Err(twig_shim::Error::io("starting the runtime", e)),
        },
        other => Err(twig_shim::Error::InvalidArgument(format!(
            "unknown action {other:?}"
        ))),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            eprintln!("{}: {e}", server::RUNTIME_ID);
            ExitCode::FAILURE
        }
    }
}
