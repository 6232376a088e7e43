//! The cluster connection, read from the kubeconfig the way kubectl reads it.

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::cli::Connection;
use crate::error::Error;

/// The cluster chosen: a client, the namespace commands act in, and the server's URL.
pub struct Cluster {
    /// The client.
    pub client: Client,
    /// `-n`, else the context's namespace, else `default`.
    pub namespace: String,
    /// The API server's URL, for error messages.
    pub server: String,
}

/// Connects to the cluster the flags and the kubeconfig choose. `retry`:
/// whether requests answered 429, 503 or 504 are sent again (kube's
/// default, with a backoff that grows to minutes over 15 tries).
pub async fn connect(connection: &Connection, retry: bool) -> Result<Cluster, Error> {
    let options = KubeConfigOptions {
        context: connection.context.clone(),
        cluster: connection.cluster.clone(),
        user: connection.user.clone(),
    };
    let mut config = match &connection.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|e| Error::Config(format!("reading {}: {e}", path.display())))?;
            Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .map_err(|e| Error::Config(format!("kubeconfig {}: {e}", path.display())))?
        }
        None if options.context.is_some()
            || options.cluster.is_some()
            || options.user.is_some() =>
        {
            Config::from_kubeconfig(&options)
                .await
                .map_err(|e| Error::Config(format!("kubeconfig: {e}")))?
        }
        None => Config::infer().await.map_err(|e| {
            Error::Config(format!(
                "no cluster configuration: {e} (set KUBECONFIG or pass --kubeconfig)"
            ))
        })?,
    };
    config.default_retry = retry;
    let namespace = connection
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let server = config.cluster_url.to_string();
    let client = Client::try_from(config)
        .map_err(|e| Error::Config(format!("client for {server}: {}", crate::error::chain(&e))))?;
    Ok(Cluster {
        client,
        namespace,
        server,
    })
}
