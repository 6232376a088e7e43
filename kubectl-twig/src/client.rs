//! The cluster connection, read from the kubeconfig the way kubectl reads it.

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

use crate::cli::Connection;
use crate::error::Error;

/// A client for the chosen cluster, and the namespace commands act in.
pub async fn connect(connection: &Connection) -> Result<(Client, String), Error> {
    let options = KubeConfigOptions {
        context: connection.context.clone(),
        cluster: connection.cluster.clone(),
        user: connection.user.clone(),
    };
    let config = match &connection.kubeconfig {
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
    let namespace = connection
        .namespace
        .clone()
        .unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).map_err(|e| Error::Config(format!("client: {e}")))?;
    Ok((client, namespace))
}
