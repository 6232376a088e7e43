//! `twig-snapshotter`: containerd proxy snapshotter on reflinked ext4 images.
//!
//! containerd config:
//! ```toml
//! [proxy_plugins.twig]
//!   type = "snapshot"
//!   address = "/run/twig/snapshotter.sock"
//! ```

use clap::Parser;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use twig_snapshotter::{service, SnapshotStore, StoreOptions};

#[derive(Parser)]
#[command(
    name = "twig-snapshotter",
    version,
    about = "containerd proxy snapshotter: every snapshot is an ext4 image, children are reflinks"
)]
struct Args {
    /// Store directory; must be on a reflink-capable filesystem (XFS with
    /// reflink=1, or btrfs).
    #[arg(long, default_value = "/var/lib/twig/snapshotter")]
    root: PathBuf,
    /// Unix socket containerd's proxy_plugins entry points at.
    #[arg(long, default_value = "/run/twig/snapshotter.sock")]
    address: PathBuf,
    /// Size of each snapshot's ext4 filesystem, in MiB (files are sparse).
    #[arg(long, default_value_t = 4096, value_parser = clap::value_parser!(u64).range(16..=1 << 24))]
    image_size_mib: u64,
    /// Copy images in full when the filesystem cannot reflink (slow, no
    /// shared blocks). Without it the snapshotter refuses to start there.
    #[arg(long)]
    allow_copy: bool,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let args = Args::parse();
    let opts = StoreOptions {
        image_size: args.image_size_mib << 20,
        allow_copy: args.allow_copy,
    };
    let root = args.root.clone();
    let store = match tokio::task::spawn_blocking(move || SnapshotStore::open(&root, &opts)).await {
        Ok(Ok(s)) => Arc::new(s),
        Ok(Err(e)) => {
            eprintln!(
                "twig-snapshotter: cannot open store {}: {e}",
                args.root.display()
            );
            return ExitCode::FAILURE;
        }
        Err(e) => {
            eprintln!("twig-snapshotter: opening the store panicked: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let signalled = async move {
        wait_for_signal().await;
        tracing::info!("shutting down");
        let _ = stop_tx.send(());
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    let server = service::serve(store, &args.address, async {
        let _ = stop_rx.await;
    });
    let result = tokio::select! {
        r = server => r,
        () = signalled => {
            tracing::warn!(grace = ?SHUTDOWN_GRACE, "clients still connected; exiting anyway");
            Ok(())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("twig-snapshotter: {e}");
            ExitCode::FAILURE
        }
    }
}

/// How long open connections may delay exit after SIGTERM/SIGINT. Every store
/// operation is crash-safe, so cutting a request short loses nothing.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

async fn wait_for_signal() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::error!(error = %e, "cannot watch SIGTERM; stop with SIGINT");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
