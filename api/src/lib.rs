//! twig-api: E2B's and CubeSandbox's sandbox API over Twig's Kubernetes
//! objects, and the traffic proxy to the sandboxes' ports. Stateless: every
//! sandbox is kept in pods, Clones and Snapshots of its tenant's namespace
//! (see [`objects`]), so replicas need no coordination.

pub mod auth;
pub mod envd;
pub mod error;
pub mod model;
pub mod objects;
pub mod proxy;
pub mod routes;
pub mod sandboxes;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{Response, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

use auth::{Tenants, TokenKey};

/// Every body twig-api sends or forwards.
pub type Body = UnsyncBoxBody<Bytes, Box<dyn std::error::Error + Send + Sync>>;

/// The HTTP client to sandboxes (envd's `/init`, proxied traffic).
pub type HttpClient = hyper_util::client::legacy::Client<HttpConnector, Body>;

/// `body` as a [`Body`].
pub fn boxed<B>(body: B) -> Body
where
    B: hyper::body::Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    body.map_err(Into::into).boxed_unsync()
}

/// A JSON answer.
pub fn json_response(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut res = Response::new(boxed(Full::new(Bytes::from(value.to_string()))));
    *res.status_mut() = status;
    res.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    res
}

/// How twig-api is set up.
pub struct Settings {
    /// The tenants and their keys.
    pub tenants: Tenants,
    /// The key sandbox tokens are derived with.
    pub tokens: TokenKey,
    /// The domain sandboxes' ports are reached under, if any.
    pub domain: Option<String>,
    /// envd's port in every sandbox.
    pub envd_port: u16,
    /// A sandbox's timeout when the create does not say (seconds).
    pub default_timeout: i64,
    /// The longest timeout a sandbox may ask for (seconds).
    pub max_timeout: i64,
    /// How long a sandbox's pod may take to be Ready.
    pub start_timeout: Duration,
    /// How long a snapshot may take to be Ready.
    pub snapshot_timeout: Duration,
}

/// The service: its Kubernetes client and settings.
pub struct App {
    client: kube::Client,
    tenants: Tenants,
    tokens: TokenKey,
    domain: Option<String>,
    envd_port: u16,
    default_timeout: i64,
    max_timeout: i64,
    start_timeout: Duration,
    snapshot_timeout: Duration,
    http: HttpClient,
    routes: proxy::Routes,
}

/// Which of its two servers a listener is.
#[derive(Clone, Copy, Debug)]
pub enum Server {
    /// The REST API.
    Control,
    /// The traffic proxy.
    Proxy,
}

impl App {
    /// The service on `client`.
    pub fn new(client: kube::Client, settings: Settings) -> Arc<Self> {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(Duration::from_secs(5)));
        Arc::new(Self {
            client,
            tenants: settings.tenants,
            tokens: settings.tokens,
            domain: settings.domain,
            envd_port: settings.envd_port,
            default_timeout: settings.default_timeout,
            max_timeout: settings.max_timeout,
            start_timeout: settings.start_timeout,
            snapshot_timeout: settings.snapshot_timeout,
            // A connection per request to a sandbox: its TCP state is guest
            // memory, which a rollback, resume or fork replaces, so a
            // pooled connection would be reset on its next request.
            http: hyper_util::client::legacy::Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(0)
                .build(connector),
            routes: proxy::Routes::default(),
        })
    }

    /// Serves `server` on `listener` until the task is dropped.
    pub async fn serve(self: Arc<Self>, listener: TcpListener, server: Server) {
        loop {
            let stream = match listener.accept().await {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(?server, "accept: {e}");
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let app = self.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let app = app.clone();
                    async move {
                        Ok::<_, std::convert::Infallible>(match server {
                            Server::Control => app.control(req).await,
                            Server::Proxy => app.proxy(req).await,
                        })
                    }
                });
                if let Err(e) = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await
                {
                    tracing::debug!(?server, "connection: {e}");
                }
            });
        }
    }

    /// Ends timed-out sandboxes of every tenant, every `every`.
    pub async fn reap_forever(self: Arc<Self>, every: Duration) {
        loop {
            for ns in self.tenants.namespaces() {
                if let Err(e) = self.reap(&ns).await {
                    tracing::warn!(namespace = %ns, "timeouts: {e}");
                }
            }
            tokio::time::sleep(every).await;
        }
    }
}
