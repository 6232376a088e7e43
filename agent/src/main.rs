//! twig-agent: PID 1 in every Twig microVM.
//!
//! As PID 1 (started by the kernel as `/init`, no `--listen`), it mounts the
//! system directories, brings up `lo`, serves ttrpc on `vsock://-1:1024` and
//! reaps every orphan. With `--listen` (tests on the host) it only serves.
//! `twig-agent __twig-init` is the agent re-executing itself as the first
//! program of a container process (see `helper.rs`).

mod cgroup;
mod container;
mod devices;
mod envd;
mod error;
mod forward;
mod helper;
mod netdev;
mod reaper;
mod reidentify;
mod seccomp;
mod service;
mod shares;
mod spawn;
mod spec;
mod stdio;
mod syscalls;
mod sysctl;
mod system;
mod volumes;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

/// The hidden first argument that makes the binary run as a container helper.
pub const HELPER_ARG: &str = "__twig-init";

#[derive(Parser, Debug)]
#[command(
    name = "twig-agent",
    version,
    about = "Twig's guest agent (PID 1 in a microVM)"
)]
struct Args {
    /// Where to serve ttrpc: `vsock://<cid>:<port>` or `unix://<path>`.
    /// Given: host mode, no system mounts even as PID 1.
    #[arg(long)]
    listen: Option<String>,
    /// Where to serve port-forward connections (`forward.rs`):
    /// `vsock://<cid>:<port>` or `unix://<path>`. Default: vsock port
    /// 1025 as PID 1; none in host mode (`--listen`) unless given.
    #[arg(long)]
    forward_listen: Option<String>,
    /// Where to take file-share connections (`shares.rs`): as
    /// `--forward-listen`, default vsock port 1026 as PID 1.
    #[arg(long)]
    share_listen: Option<String>,
    /// Directory for container state and rootfs mounts.
    #[arg(long, default_value = "/run/twig")]
    state_dir: PathBuf,
    /// Directory of the guest volumes (a tmpfs is mounted there on first
    /// use); the shim's OCI specs name it, so only tests change it.
    #[arg(long, default_value = twig_agent::proto::GUEST_VOLUMES_DIR)]
    volumes_dir: PathBuf,
    /// Never pivot_root into a container's rootfs; move it onto / and chroot
    /// instead (what happens anyway when pivot_root is impossible).
    #[arg(long)]
    no_pivot_root: bool,
}

fn main() {
    if std::env::args_os().nth(1).is_some_and(|a| a == HELPER_ARG) {
        helper::main();
    }
    let args = match Args::try_parse() {
        Ok(args) => args,
        // The kernel hands init every command-line word it does not know:
        // PID 1 must not exit over them (that panics the kernel).
        Err(e) if std::process::id() == 1 => {
            eprintln!("twig-agent: ignoring the arguments: {e}");
            Args::parse_from(["twig-agent"])
        }
        Err(e) => e.exit(),
    };
    let pid1 = std::process::id() == 1 && args.listen.is_none();
    if pid1 {
        system::setup_console();
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    // Block SIGCHLD before any thread exists so that every thread inherits
    // the mask and only the reaper thread receives it (with sigwait).
    if let Err(e) = reaper::block_sigchld() {
        tracing::error!("blocking SIGCHLD: {e}");
    }
    if pid1 {
        system::setup_pid1();
    }
    let listen = args
        .listen
        .clone()
        .unwrap_or_else(|| format!("vsock://-1:{}", twig_agent::AGENT_VSOCK_PORT));
    let reaper = reaper::Reaper::start();
    let agent = Arc::new(service::AgentService::new(
        reaper,
        args.state_dir.clone(),
        args.volumes_dir.clone(),
        args.no_pivot_root,
        pid1,
    ));
    loop {
        match service::serve(&listen, agent.clone()) {
            Ok(server) => {
                start_side_listeners(&args, pid1);
                system::announce_ready(pid1);
                // The server runs on its own threads; keep it alive forever.
                let _server = server;
                loop {
                    std::thread::park();
                }
            }
            Err(e) if pid1 => {
                // PID 1 must never exit: keep trying (vsock may appear late).
                tracing::error!("serving on {listen}: {e}; retrying in 1 s");
                std::thread::sleep(Duration::from_secs(1));
            }
            Err(e) => {
                tracing::error!("serving on {listen}: {e}");
                std::process::exit(1);
            }
        }
    }
}

/// The port-forward and file-share listeners: `--forward-listen` and
/// `--share-listen`, else vsock ports 1025 and 1026 unless in host mode
/// (`--listen`). A failure costs that listener only as PID 1 (it goes on);
/// otherwise it ends the agent, so a test sees it.
fn start_side_listeners(args: &Args, pid1: bool) {
    start_listener(
        "port-forward",
        &args.forward_listen,
        twig_agent::proto::FORWARD_VSOCK_PORT,
        args,
        pid1,
        forward::start,
    );
    start_listener(
        "file-share",
        &args.share_listen,
        twig_agent::proto::FILE_SHARE_VSOCK_PORT,
        args,
        pid1,
        shares::start,
    );
}

/// A side listener (`what`): `given`, else vsock `port` unless in host mode.
fn start_listener(
    what: &str,
    given: &Option<String>,
    port: u32,
    args: &Args,
    pid1: bool,
    start: fn(&str) -> std::io::Result<()>,
) {
    let listen = match (given, args.listen.is_none()) {
        (Some(l), _) => l.clone(),
        (None, true) => format!("vsock://-1:{port}"),
        (None, false) => return,
    };
    if let Err(e) = start(&listen) {
        tracing::error!("{what} on {listen}: {e}");
        if !pid1 {
            std::process::exit(1);
        }
    }
}
