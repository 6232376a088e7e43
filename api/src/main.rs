//! `twig-api`: the sandbox API server (E2B/CubeSandbox REST API on one
//! port, the traffic proxy on another).

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tokio::net::TcpListener;
use twig_api::auth::{Tenants, TokenKey};
use twig_api::{App, Server, Settings};

/// Twig's sandbox API: E2B- and CubeSandbox-compatible.
#[derive(Parser)]
#[command(version)]
struct Args {
    /// Address of the REST API.
    #[arg(long, env = "TWIG_API_LISTEN", default_value = "0.0.0.0:3000")]
    listen: String,
    /// Address of the traffic proxy (`<port>-<id>.<domain>`).
    #[arg(long, env = "TWIG_API_PROXY_LISTEN", default_value = "0.0.0.0:8080")]
    proxy_listen: String,
    /// The API key file (YAML: tenants, each a namespace and its keys' SHA-256).
    #[arg(long, env = "TWIG_API_KEYS")]
    keys: PathBuf,
    /// A file of at least 32 secret bytes sandbox access tokens derive from
    /// (the same for every replica).
    #[arg(long, env = "TWIG_API_TOKEN_SECRET")]
    token_secret: PathBuf,
    /// The domain sandboxes' ports are published under, as the SDKs' `domain`.
    #[arg(long, env = "TWIG_API_DOMAIN")]
    domain: Option<String>,
    /// envd's port in each sandbox.
    #[arg(long, default_value_t = 49983)]
    envd_port: u16,
    /// Timeout of a sandbox whose create names none, in seconds.
    #[arg(long, default_value_t = 300)]
    default_timeout: i64,
    /// Longest timeout a sandbox may ask for, in seconds.
    #[arg(long, default_value_t = 86_400)]
    max_timeout: i64,
    /// Seconds a sandbox's pod may take to be Ready.
    #[arg(long, default_value_t = 120)]
    start_timeout: u64,
    /// Seconds a snapshot may take.
    #[arg(long, default_value_t = 120)]
    snapshot_timeout: u64,
    /// How often timed-out sandboxes are looked for, in milliseconds.
    #[arg(long, default_value_t = 1000)]
    reap_every_ms: u64,
}

#[tokio::main]
async fn main() -> Result<(), String> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    let tenants = Tenants::load(&args.keys).map_err(|e| e.to_string())?;
    let secret = std::fs::read(&args.token_secret)
        .map_err(|e| format!("reading {}: {e}", args.token_secret.display()))?;
    let tokens = TokenKey::new(&secret)?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| format!("connecting to the Kubernetes API: {e}"))?;
    let app = App::new(
        client,
        Settings {
            tenants,
            tokens,
            domain: args.domain,
            envd_port: args.envd_port,
            default_timeout: args.default_timeout,
            max_timeout: args.max_timeout,
            start_timeout: Duration::from_secs(args.start_timeout),
            snapshot_timeout: Duration::from_secs(args.snapshot_timeout),
        },
    );
    let control = TcpListener::bind(&args.listen)
        .await
        .map_err(|e| format!("listening on {}: {e}", args.listen))?;
    let proxy = TcpListener::bind(&args.proxy_listen)
        .await
        .map_err(|e| format!("listening on {}: {e}", args.proxy_listen))?;
    tracing::info!(api = %args.listen, proxy = %args.proxy_listen, "serving");
    tokio::spawn(app.clone().serve(control, Server::Control));
    tokio::spawn(app.clone().serve(proxy, Server::Proxy));
    tokio::spawn(app.reap_forever(Duration::from_millis(args.reap_every_ms)));
    tokio::signal::ctrl_c()
        .await
        .map_err(|e| format!("waiting for a signal: {e}"))?;
    Ok(())
}
