//! `twig-node`: the node daemon (see the crate's README).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use twig_node::config::DEFAULT_CONFIG_PATH;
use twig_node::{Config, Daemon};

/// Twig's node daemon: the node store, the template cache and the warm
/// twig-vmm pool; serves twig.v1.Node and twig.node.v1.Pool on one ttrpc
/// socket until SIGTERM or SIGINT. Logs go to stderr (RUST_LOG filters).
#[derive(Parser)]
#[command(name = "twig-node", version)]
struct Cli {
    /// The JSON configuration file (missing default file: all defaults).
    #[arg(long)]
    config: Option<PathBuf>,
}

async fn run(config: Config) -> twig_node::Result<()> {
    let map = |e: std::io::Error| twig_node::Error::io("installing signal handlers", e);
    let mut term = signal(SignalKind::terminate()).map_err(map)?;
    let mut int = signal(SignalKind::interrupt()).map_err(map)?;
    let daemon = Daemon::start(&config).await?;
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("stopping");
    daemon.stop().await;
    Ok(())
}

fn main() -> ExitCode {
    let spec = std::env::var("RUST_LOG").ok();
    tracing_subscriber::fmt()
        .with_env_filter(twig_node::log_filter(spec.as_deref()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let config = match &cli.config {
        Some(p) => Config::from_file(p, true),
        None => Config::from_file(std::path::Path::new(DEFAULT_CONFIG_PATH), false),
    };
    let config = match config {
        Ok(c) => c,
        Err(e) => {
            eprintln!("twig-node: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("twig-node: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("twig-node: {e}");
            ExitCode::FAILURE
        }
    }
}
