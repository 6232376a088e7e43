//! The `proxy` subresources of Services and Pods, as kube-apiserver serves
//! them (what `kubectl get --raw …/proxy/…` calls), GET only:
//!
//! - `/api/v1/namespaces/NS/services/NAME[:PORT]/proxy/PATH`: the Service
//!   must exist (else 404); PORT is a Service port's name or number (a
//!   number is translated to that port's name, 503 when the Service has no
//!   such port; no PORT: the unnamed port). The Endpoints object of the same
//!   name (404 if missing) gives the address: the first subset with
//!   addresses and a port of that name. kube-apiserver picks a subset and an
//!   address at random; this server takes them in turn, one request after
//!   the other, so a client that relies on reaching one particular endpoint
//!   through a Service fails here as it would in a cluster. No address: 503
//!   `no endpoints available for service "NAME"`.
//! - `/api/v1/namespaces/NS/pods/NAME[:PORT]/proxy/PATH`: the pod's
//!   `status.podIP` (503 when it has none), PORT a number or, without one,
//!   the pod's first container port.
//!
//! The request goes to `http://ADDRESS:PORT/PATH?QUERY`; the answer's status,
//! content type and body come back as they are. A backend that cannot be
//! reached is kube-apiserver's 503 `error trying to reach service: …`.
//! Unlike kube-apiserver, loopback addresses are allowed (the tests' backends
//! listen on 127.0.0.1); `https:` schemes are not supported.

use std::sync::atomic::Ordering;
use std::time::Duration;

use http_body_util::{BodyExt, Empty, Full};
use hyper::body::Bytes;
use hyper::{Method, Response, StatusCode, Uri};
use serde_json::Value;

use super::{lock, status_error, Body, Key, State, Target};

/// How long a backend may take to answer.
const BACKEND_TIMEOUT: Duration = Duration::from_secs(30);

/// Serves a `proxy` subresource request.
pub(super) async fn serve(
    state: &State,
    target: &Target,
    method: &Method,
    uri: &Uri,
) -> Response<Body> {
    if method != Method::GET {
        return status_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{method} on the proxy subresource is not supported by the test API server"),
        );
    }
    let (Some(namespace), Some(id)) = (&target.namespace, &target.name) else {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no route for {}", uri.path()),
        );
    };
    let address = match (target.api.as_str(), target.plural.as_str()) {
        ("api/v1", "services") => service_address(state, namespace, id),
        ("api/v1", "pods") => pod_address(state, namespace, id),
        _ => Err(Refusal {
            code: StatusCode::NOT_FOUND,
            reason: "NotFound",
            message: format!("{} have no proxy subresource", target.plural),
        }),
    };
    let address = match address {
        Ok(address) => address,
        Err(refusal) => return status_error(refusal.code, refusal.reason, refusal.message),
    };
    let marker = format!("/{}/{id}/proxy", target.plural);
    let rest = uri.path().split_once(&marker).map_or("", |(_, rest)| rest);
    let rest = if rest.is_empty() { "/" } else { rest };
    let url = match uri.query() {
        Some(query) => format!("http://{address}{rest}?{query}"),
        None => format!("http://{address}{rest}"),
    };
    forward(&url).await
}

/// Why a proxy request has no backend: the Status it is answered with.
struct Refusal {
    code: StatusCode,
    reason: &'static str,
    message: String,
}

/// `name` or `name:port` (kube-apiserver also takes `scheme:name:port`).
fn split_id(id: &str) -> Result<(&str, &str), Refusal> {
    match id.split(':').collect::<Vec<_>>()[..] {
        [name] => Ok((name, "")),
        [name, port] => Ok((name, port)),
        _ => Err(Refusal {
            code: StatusCode::BAD_REQUEST,
            reason: "BadRequest",
            message: format!(
                "invalid proxy request {id:?} (the test API server takes NAME or NAME:PORT)"
            ),
        }),
    }
}

fn core_key(plural: &str, namespace: &str, name: &str) -> Key {
    Key {
        api: "api/v1".into(),
        plural: plural.into(),
        namespace: namespace.into(),
        name: name.into(),
    }
}

fn not_found(plural: &str, name: &str) -> Refusal {
    Refusal {
        code: StatusCode::NOT_FOUND,
        reason: "NotFound",
        message: format!("{plural} \"{name}\" not found"),
    }
}

fn unavailable(message: String) -> Refusal {
    Refusal {
        code: StatusCode::SERVICE_UNAVAILABLE,
        reason: "ServiceUnavailable",
        message,
    }
}

/// `ip:port` of an endpoint of the Service `id` names.
fn service_address(state: &State, namespace: &str, id: &str) -> Result<String, Refusal> {
    let (name, port) = split_id(id)?;
    let inner = lock(state);
    let Some(service) = inner.objects.get(&core_key("services", namespace, name)) else {
        return Err(not_found("services", name));
    };
    let port_name = match port.parse::<i64>() {
        Ok(number) => service["spec"]["ports"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["port"].as_i64() == Some(number))
            .map(|p| p["name"].as_str().unwrap_or_default().to_string())
            .ok_or_else(|| {
                unavailable(format!(
                    "no service port {number} found for service \"{name}\""
                ))
            })?,
        Err(_) => port.to_string(),
    };
    let Some(endpoints) = inner.objects.get(&core_key("endpoints", namespace, name)) else {
        return Err(not_found("endpoints", name));
    };
    let candidates: Vec<String> = endpoints["subsets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|subset| {
            let port = subset["ports"]
                .as_array()?
                .iter()
                .find(|p| p["name"].as_str().unwrap_or_default() == port_name)?
                .get("port")?
                .as_u64()?;
            let ips: Vec<String> = subset["addresses"]
                .as_array()?
                .iter()
                .filter_map(|a| a["ip"].as_str())
                .map(|ip| join_host_port(ip, port))
                .collect();
            Some(ips)
        })
        .flatten()
        .collect();
    if candidates.is_empty() {
        return Err(unavailable(format!(
            "no endpoints available for service \"{id}\""
        )));
    }
    let turn = state.proxy_turn.fetch_add(1, Ordering::Relaxed);
    Ok(candidates[turn % candidates.len()].clone())
}

/// `ip:port` of the pod `id` names.
fn pod_address(state: &State, namespace: &str, id: &str) -> Result<String, Refusal> {
    let (name, port) = split_id(id)?;
    let inner = lock(state);
    let Some(pod) = inner.objects.get(&core_key("pods", namespace, name)) else {
        return Err(not_found("pods", name));
    };
    let Some(ip) = pod["status"]["podIP"].as_str().filter(|ip| !ip.is_empty()) else {
        return Err(unavailable(format!("pod \"{name}\" has no IP address")));
    };
    let port = if port.is_empty() {
        first_container_port(pod)
    } else {
        port.parse::<u64>().ok()
    };
    match port {
        Some(port) => Ok(join_host_port(ip, port)),
        None => Err(Refusal {
            code: StatusCode::BAD_REQUEST,
            reason: "BadRequest",
            message: format!("no port to proxy to on pod \"{name}\" (give NAME:PORT, a number)"),
        }),
    }
}

fn first_container_port(pod: &Value) -> Option<u64> {
    pod["spec"]["containers"]
        .as_array()?
        .iter()
        .find_map(|c| c["ports"][0]["containerPort"].as_u64())
}

fn join_host_port(ip: &str, port: u64) -> String {
    if ip.contains(':') {
        format!("[{ip}]:{port}")
    } else {
        format!("{ip}:{port}")
    }
}

/// GETs `url`; its status, content type and body.
async fn forward(url: &str) -> Response<Body> {
    let unreachable = |cause: String| {
        let refusal = unavailable(format!("error trying to reach service: {cause}"));
        status_error(refusal.code, refusal.reason, refusal.message)
    };
    let uri: Uri = match url.parse() {
        Ok(uri) => uri,
        Err(e) => return unreachable(format!("{url}: {e}")),
    };
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Empty<Bytes>>();
    let authority = uri.authority().map(ToString::to_string).unwrap_or_default();
    let answer = tokio::time::timeout(BACKEND_TIMEOUT, async {
        let response = client.get(uri).await.map_err(|e| chain(&e))?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok::<_, String>((parts, body))
    })
    .await;
    let (parts, body) = match answer {
        Ok(Ok(answer)) => answer,
        Ok(Err(cause)) => return unreachable(format!("{authority}: {cause}")),
        Err(_) => return unreachable(format!("{url}: no answer in {BACKEND_TIMEOUT:?}")),
    };
    let mut response = Response::new(Full::new(body).boxed_unsync());
    *response.status_mut() = parts.status;
    if let Some(content_type) = parts.headers.get(hyper::header::CONTENT_TYPE) {
        response
            .headers_mut()
            .insert(hyper::header::CONTENT_TYPE, content_type.clone());
    }
    response
}

/// An error with its causes, `a: b: c`.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}
