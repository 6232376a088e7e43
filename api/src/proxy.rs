//! The traffic proxy: `<port>-<sandboxID>.<domain>` (the Host header), or
//! the `E2b-Sandbox-Id` and `E2b-Sandbox-Port` headers the SDKs send with
//! `E2B_SANDBOX_URL`, routed to the sandbox pod's IP and port. envd's port
//! needs the sandbox's envd access token; the other ports need its traffic
//! token when the sandbox's traffic is not public.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode};
use hyper::body::Incoming;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::{Api, ResourceExt};

use crate::auth::TokenKind;
use crate::objects::{PUBLIC_TRAFFIC_ANNOTATION, SANDBOX_LABEL};
use crate::{json_response, App, Body};

/// How long a sandbox's address is reused without asking the API again.
const ROUTE_TTL: Duration = Duration::from_secs(1);

/// Headers that belong to one hop, never forwarded.
const HOP_BY_HOP: [&str; 8] = [
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Where a sandbox's traffic goes.
#[derive(Clone)]
struct Route {
    ns: String,
    ip: String,
    public: bool,
    at: Instant,
}

/// Recently resolved sandboxes.
#[derive(Default)]
pub struct Routes(Mutex<HashMap<String, Route>>);

/// The sandbox and port a request is for.
fn target(headers: &HeaderMap, domain: Option<&str>) -> Option<(String, u16)> {
    let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    if let (Some(id), Some(port)) = (header("e2b-sandbox-id"), header("e2b-sandbox-port")) {
        return Some((id.to_string(), port.parse().ok()?));
    }
    let host = header("host")?;
    let host = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let (label, rest) = host.split_once('.')?;
    if domain.is_some_and(|d| d != rest) {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    Some((id.to_string(), port.parse().ok()?))
}

fn error(status: StatusCode, message: &str) -> Response<Body> {
    json_response(
        status,
        &serde_json::json!({"code": status.as_u16(), "message": message}),
    )
}

impl App {
    async fn route(&self, id: &str) -> Result<Option<Route>, kube::Error> {
        if let Ok(routes) = self.routes.0.lock() {
            if let Some(r) = routes.get(id).filter(|r| r.at.elapsed() < ROUTE_TTL) {
                return Ok(Some(r.clone()));
            }
        }
        let lp = ListParams::default().labels(&format!("{SANDBOX_LABEL}={id}"));
        for ns in self.tenants.namespaces() {
            let pods: Api<Pod> = Api::namespaced(self.client.clone(), &ns);
            for pod in pods.list(&lp).await?.items {
                let ip = pod.status.as_ref().and_then(|s| s.pod_ip.clone());
                let (Some(ip), None) = (ip, pod.metadata.deletion_timestamp.as_ref()) else {
                    continue;
                };
                let route = Route {
                    public: pod
                        .annotations()
                        .get(PUBLIC_TRAFFIC_ANNOTATION)
                        .is_none_or(|v| v != "false"),
                    ns: ns.clone(),
                    ip,
                    at: Instant::now(),
                };
                if let Ok(mut routes) = self.routes.0.lock() {
                    routes.retain(|_, r| r.at.elapsed() < ROUTE_TTL);
                    routes.insert(id.to_string(), route.clone());
                }
                return Ok(Some(route));
            }
        }
        Ok(None)
    }

    /// Serves one proxied request.
    pub async fn proxy(&self, req: Request<Incoming>) -> Response<Body> {
        let Some((id, port)) = target(req.headers(), self.domain.as_deref()) else {
            return error(
                StatusCode::BAD_REQUEST,
                "no sandbox named: use the host <port>-<sandboxID>.<domain> or the E2b-Sandbox-Id and E2b-Sandbox-Port headers",
            );
        };
        if !crate::auth::is_dns_label(&id) || port == 0 {
            return error(
                StatusCode::BAD_GATEWAY,
                &format!("sandbox '{id}' not found"),
            );
        }
        let route = match self.route(&id).await {
            Ok(Some(route)) => route,
            Ok(None) => {
                return error(
                    StatusCode::BAD_GATEWAY,
                    &format!("sandbox '{id}' not found or not running"),
                )
            }
            Err(e) => {
                return error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("looking up sandbox '{id}': {e}"),
                )
            }
        };
        let header = |name: &str| req.headers().get(name).and_then(|v| v.to_str().ok());
        let allowed = if port == self.envd_port {
            header("x-access-token")
                .is_some_and(|t| self.tokens.check(TokenKind::Envd, &route.ns, &id, t))
        } else {
            route.public
                || header("e2b-traffic-access-token")
                    .or_else(|| header("cube-traffic-access-token"))
                    .is_some_and(|t| self.tokens.check(TokenKind::Traffic, &route.ns, &id, t))
        };
        if !allowed {
            return error(
                StatusCode::UNAUTHORIZED,
                &format!("missing or wrong access token for port {port} of sandbox '{id}'"),
            );
        }
        let (mut parts, body) = req.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string();
        let authority = crate::envd::host_port(&route.ip, port);
        let uri = match format!("http://{authority}{path}").parse() {
            Ok(uri) => uri,
            Err(_) => return error(StatusCode::BAD_REQUEST, "bad request path"),
        };
        parts.uri = uri;
        strip_hop_by_hop(&mut parts.headers);
        if let Ok(host) = HeaderValue::from_str(&authority) {
            parts.headers.insert(http::header::HOST, host);
        }
        let forwarded = Request::from_parts(parts, crate::boxed(body));
        match self.http.request(forwarded).await {
            Ok(res) => {
                let (mut parts, body) = res.into_parts();
                strip_hop_by_hop(&mut parts.headers);
                Response::from_parts(parts, crate::boxed(body))
            }
            Err(e) => error(
                StatusCode::BAD_GATEWAY,
                &format!("port {port} of sandbox '{id}' is not answering: {e}"),
            ),
        }
    }
}

fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        pairs
            .iter()
            .map(|(k, v)| {
                (
                    http::header::HeaderName::from_static(k),
                    HeaderValue::from_static(v),
                )
            })
            .collect()
    }

    #[test]
    fn requests_name_their_sandbox_by_host_or_headers() {
        let by_host = headers(&[("host", "49983-iabc.twig.local:8080")]);
        assert_eq!(
            target(&by_host, Some("twig.local")),
            Some(("iabc".to_string(), 49983))
        );
        assert_eq!(target(&by_host, Some("other.domain")), None);
        let by_headers = headers(&[
            ("host", "127.0.0.1:8080"),
            ("e2b-sandbox-id", "iabc"),
            ("e2b-sandbox-port", "49999"),
        ]);
        assert_eq!(target(&by_headers, None), Some(("iabc".to_string(), 49999)));
        assert_eq!(target(&headers(&[("host", "x-y.z")]), None), None);
        assert_eq!(target(&headers(&[("host", "99999-a.z")]), None), None);
    }
}
