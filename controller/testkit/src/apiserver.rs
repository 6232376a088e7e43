//! An in-process Kubernetes API server for tests (never shipped).
//!
//! It speaks the REST and JSON that kube's `Client` speaks, over plain HTTP on
//! 127.0.0.1, and implements what the controller uses with the real
//! semantics: create/get/list/replace/merge-patch/delete; list and watch from
//! a resourceVersion; label and field selectors; the status subresource (the
//! main resource ignores `status`, `/status` ignores everything else);
//! optimistic concurrency (409 Conflict on a stale resourceVersion, 409
//! AlreadyExists); `generation` bumped on spec changes; finalizers and
//! `deletionTimestamp`; background garbage collection through
//! `ownerReferences` (also of objects created for an owner already gone);
//! admission of custom resources against their CRD schema and CEL rules
//! (see `schema.rs`), and of any write against the ValidatingAdmissionPolicies
//! a test puts in force, for callers that say who they are (`policy.rs`);
//! JSON Patch (RFC 6902, with kube-apiserver's `test` of
//! `null` passing on a missing field); field ownership (`managedFields`) on
//! every write and server-side apply with `fieldManager` and `force`,
//! merging by the CRD schema's list types (see `ssa.rs`); cluster-scoped
//! Nodes; the `proxy` subresources of Services (through their Endpoints)
//! and Pods, forwarding GETs to backends on 127.0.0.1 (`proxy.rs`); and
//! kube-apiserver's 403 for the accesses a test forbids, with every access
//! recorded per actor (`authz.rs`). For the real kubectl it also serves discovery and OpenAPI v3
//! (`discovery.rs`), `meta.k8s.io/v1` Tables from the CRDs' printer columns
//! (`table.rs`) and server-side field validation (`fields.rs`). What it does
//! not do: a client's own `managedFields` in a request body are ignored (the
//! server keeps its own); unknown fields are not pruned; no strategic merge
//! patch, aggregated discovery or OpenAPI v2.

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use k8s_openapi::jiff::Timestamp;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{broadcast, mpsc};
use tokio::task::JoinHandle;

use super::ssa::{self, Manager, Schema, Scope, Writer};

mod authz;
mod discovery;
mod fields;
mod patch;
mod policy;
mod proxy;
mod select;
mod table;
use patch::{json_patch, merge_patch, server_side_apply};
use select::{parse_selector, Filter};

pub use policy::{EXTRA_HEADER, USER_HEADER};

/// The header that names who sends a request (see [`TestApiServer::client_as`]).
pub const ACTOR_HEADER: &str = "x-test-actor";

/// One kind of access as RBAC sees it: verb, API group, resource (with subresource).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Access {
    /// Who asked ([`ACTOR_HEADER`]).
    pub actor: String,
    /// The RBAC verb (`get`, `list`, `watch`, `create`, `patch`, …).
    pub verb: String,
    /// The API group (`""` for the core group).
    pub group: String,
    /// The resource, with `/subresource` when one was named.
    pub resource: String,
}

/// Admission check of a new object (and the old one on update); `Err` is the message of a 422.
pub type Validator = Arc<dyn Fn(&str, &Value, Option<&Value>) -> Result<(), String> + Send + Sync>;

type Body = UnsyncBoxBody<Bytes, Infallible>;

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Key {
    api: String,
    plural: String,
    namespace: String,
    name: String,
}

#[derive(Debug)]
struct Change {
    kind: &'static str,
    api: String,
    plural: String,
    namespace: String,
    rv: u64,
    object: Value,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    uids: u64,
    /// The first group of every UID this server gives, unique to it: UIDs
    /// are unique across servers, as kube-apiserver's random ones are (two
    /// tests' servers in one node store must not give the same snapshot
    /// UID).
    uid_epoch: u32,
    objects: BTreeMap<Key, Value>,
    managed: ssa::Table<Key>,
    history: Vec<Arc<Change>>,
}

struct State {
    inner: Mutex<Inner>,
    /// (actor, verb, group, resource) of every request that named its actor.
    requests: Mutex<BTreeSet<Access>>,
    /// (verb, group, resource) every caller is refused (see [`TestApiServer::forbid`]).
    forbidden: Mutex<BTreeSet<(String, String, String)>>,
    /// ValidatingAdmissionPolicies with their bindings (see [`TestApiServer::enforce`]).
    policies: Mutex<Vec<(Value, Value)>>,
    /// Which endpoint address the next service proxy request goes to.
    proxy_turn: AtomicUsize,
    changes: broadcast::Sender<Arc<Change>>,
    validator: Option<Validator>,
    /// Each CustomResourceDefinition, by plural.
    crds: BTreeMap<String, Value>,
}

impl State {
    fn schema(&self, plural: &str) -> Schema {
        Schema::new(
            self.crds
                .get(plural)
                .map(|crd| &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]),
        )
    }
}

/// The running server; stops when dropped.
pub struct TestApiServer {
    /// The address it listens on (127.0.0.1).
    pub addr: SocketAddr,
    task: JoinHandle<()>,
    state: Arc<State>,
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl TestApiServer {
    /// Starts a server on a free port of 127.0.0.1 that knows no CRD schemas.
    pub async fn start(validator: Option<Validator>) -> Self {
        Self::start_with(validator, BTreeMap::new()).await
    }

    /// Starts a server that serves these CustomResourceDefinitions (by
    /// plural): discovery, OpenAPI, printer columns, and applies merged by
    /// their schemas.
    pub async fn start_with(validator: Option<Validator>, crds: BTreeMap<String, Value>) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind test API server");
        let addr = listener.local_addr().expect("local addr");
        let (changes, _) = broadcast::channel(8192);
        let state = Arc::new(State {
            inner: Mutex::new(Inner {
                uid_epoch: uid_epoch(),
                ..Inner::default()
            }),
            requests: Mutex::default(),
            forbidden: Mutex::default(),
            policies: Mutex::default(),
            proxy_turn: AtomicUsize::new(0),
            changes,
            validator,
            crds,
        });
        let state_handle = state.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    return;
                };
                let state = state.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let state = state.clone();
                        async move { Ok::<_, Infallible>(handle(state, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        Self {
            addr,
            task,
            state: state_handle,
        }
    }

    /// A kube client whose requests are recorded as `actor`'s.
    pub fn client_as(&self, actor: &str) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("url");
        let mut config = kube::Config::new(url);
        config.headers.push((
            hyper::header::HeaderName::from_static(ACTOR_HEADER),
            hyper::header::HeaderValue::from_str(actor).expect("actor header"),
        ));
        plain_http_client(config)
    }

    /// A kube client whose requests are recorded as `actor`'s and checked
    /// by the policies in force as those of `username` with these extra
    /// `(key, value)` pairs (a bound token's `authentication.kubernetes.io/…`).
    pub fn client_as_user(
        &self,
        actor: &str,
        username: &str,
        extra: &[(&str, &str)],
    ) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("url");
        let mut config = kube::Config::new(url);
        let header = |name: &'static str, value: &str| {
            (
                hyper::header::HeaderName::from_static(name),
                hyper::header::HeaderValue::from_str(value).expect("header value"),
            )
        };
        config.headers.push(header(ACTOR_HEADER, actor));
        config.headers.push(header(USER_HEADER, username));
        for (k, v) in extra {
            config
                .headers
                .push(header(EXTRA_HEADER, &format!("{k}={v}")));
        }
        plain_http_client(config)
    }

    /// Enforces a ValidatingAdmissionPolicy (bound by `binding`) on every
    /// create, update and delete by a caller with a username
    /// ([`TestApiServer::client_as_user`]), as kube-apiserver does; a
    /// refusal is its 403 (reason `Forbidden`) or 422.
    pub fn enforce(&self, policy: Value, binding: Value) {
        self.state
            .policies
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push((policy, binding));
    }

    /// Every kind of access `actor` has made so far.
    pub fn accesses(&self, actor: &str) -> BTreeSet<Access> {
        self.state
            .requests
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .filter(|a| a.actor == actor)
            .cloned()
            .collect()
    }

    /// Refuses every request for `verb` on `resource` (with `/subresource`,
    /// e.g. `pods/proxy`) of API `group` (`""`: core) with kube-apiserver's
    /// 403 Forbidden, as RBAC does for a user without that rule.
    pub fn forbid(&self, verb: &str, group: &str, resource: &str) {
        self.state
            .forbidden
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .insert((verb.to_string(), group.to_string(), resource.to_string()));
    }

    /// How many watches are open (a client waiting on a watch counts once per watch).
    pub fn open_watches(&self) -> usize {
        self.state.changes.receiver_count()
    }

    /// A kube client for this server, default namespace `default`.
    pub fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("url");
        plain_http_client(kube::Config::new(url))
    }
}

/// A kube client over plain HTTP, without kube's TLS stack: building that
/// loads the system's CA certificates, and fails where there are none (the
/// nested lab) even for an `http://` server.
fn plain_http_client(config: kube::Config) -> kube::Client {
    use kube::client::ConfigExt;
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let service = tower::ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .layer(config.extra_headers_layer().expect("extra headers"))
        .service(http);
    kube::Client::new(service, config.default_namespace)
}

fn lock(state: &State) -> MutexGuard<'_, Inner> {
    state
        .inner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn kind_of(plural: &str) -> &'static str {
    match plural {
        "pods" => "Pod",
        "events" => "Event",
        "snapshots" => "Snapshot",
        "clones" => "Clone",
        "rollbacks" => "Rollback",
        "sandboxtemplates" => "SandboxTemplate",
        "nodes" => "Node",
        "services" => "Service",
        "endpoints" => "Endpoints",
        "endpointslices" => "EndpointSlice",
        "configmaps" => "ConfigMap",
        "secrets" => "Secret",
        "serviceaccounts" => "ServiceAccount",
        _ => "Unknown",
    }
}

fn api_version(api: &str) -> String {
    api.strip_prefix("apis/")
        .or_else(|| api.strip_prefix("api/"))
        .unwrap_or(api)
        .to_string()
}

fn has_status(plural: &str) -> bool {
    !matches!(
        plural,
        "events" | "endpoints" | "endpointslices" | "configmaps" | "secrets" | "serviceaccounts"
    )
}

fn cluster_scoped(plural: &str) -> bool {
    plural == "nodes"
}

fn scope(plural: &str, status: bool) -> Scope {
    if status {
        Scope::Status
    } else {
        Scope::Main {
            has_status: has_status(plural),
        }
    }
}

fn now() -> String {
    k8s_openapi::jiff::fmt::strtime::format("%Y-%m-%dT%H:%M:%SZ", Timestamp::now())
        .expect("format time")
}

fn full(status: StatusCode, body: &Value) -> Response<Body> {
    let mut resp = Response::new(Full::new(Bytes::from(body.to_string())).boxed_unsync());
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn status_error(code: StatusCode, reason: &str, message: String) -> Response<Body> {
    let body = json!({
        "kind": "Status", "apiVersion": "v1", "metadata": {},
        "status": "Failure", "message": message, "reason": reason, "code": code.as_u16(),
    });
    full(code, &body)
}

struct Target {
    api: String,
    namespace: Option<String>,
    plural: String,
    name: Option<String>,
    subresource: Option<String>,
}

fn parse_path(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (api, rest) = match *segs.first()? {
        "api" => (format!("api/{}", segs.get(1)?), &segs[2..]),
        "apis" => (
            format!("apis/{}/{}", segs.get(1)?, segs.get(2)?),
            &segs[3..],
        ),
        _ => return None,
    };
    let (namespace, rest) = if rest.first() == Some(&"namespaces") && rest.len() >= 3 {
        (Some(rest[1].to_string()), &rest[2..])
    } else {
        (None, rest)
    };
    Some(Target {
        api,
        namespace,
        plural: rest.first()?.to_string(),
        name: rest.get(1).map(|s| s.to_string()),
        subresource: rest.get(2).map(|s| s.to_string()),
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query(req: &Request<Incoming>) -> BTreeMap<String, String> {
    req.uri()
        .query()
        .unwrap_or_default()
        .split('&')
        .filter(|kv| !kv.is_empty())
        .map(|kv| {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

async fn handle(state: Arc<State>, req: Request<Incoming>) -> Response<Body> {
    let path = req.uri().path().to_string();
    if req.method() == Method::GET {
        if let Some(resp) = discovery::serve(&state, &path) {
            return resp;
        }
    }
    let Some(target) = parse_path(&path) else {
        return status_error(
            StatusCode::NOT_FOUND,
            "NotFound",
            format!("no route for {path}"),
        );
    };
    let params = query(&req);
    let method = req.method().clone();
    let caller = policy::caller(req.headers(), target.subresource.as_deref());
    let actor = req
        .headers()
        .get(ACTOR_HEADER)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let access = authz::access(&target, &method, &params, actor.as_deref());
    if let Some(refused) = authz::check(&state, &target, access) {
        return refused;
    }
    if target.subresource.as_deref() == Some("proxy") {
        return proxy::serve(&state, &target, &method, req.uri()).await;
    }
    let content_type = req
        .headers()
        .get(hyper::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    // Like kube-apiserver: the fieldManager parameter, else the user agent up to its first '/'.
    let user_agent = req
        .headers()
        .get(hyper::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("unknown");
    let manager = params.get("fieldManager").cloned().unwrap_or_else(|| {
        user_agent
            .split('/')
            .next()
            .unwrap_or(user_agent)
            .to_string()
    });
    let accept = req
        .headers()
        .get(hyper::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = match req.into_body().collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
    };
    let warnings = match fields::validate(&state, &target, &method, &content_type, &params, &body) {
        Ok(warnings) => warnings,
        Err(message) => return status_error(StatusCode::BAD_REQUEST, "BadRequest", message),
    };
    let request = Call {
        method,
        content_type,
        accept,
        manager,
        params,
        body,
    };
    let mut resp = policy::serve_as(caller, || dispatch(&state, &target, &path, &request));
    for warning in warnings {
        if let Ok(value) = hyper::header::HeaderValue::from_str(&warning) {
            resp.headers_mut().append("warning", value);
        }
    }
    resp
}

/// The parts of a request [`dispatch`] acts on.
struct Call {
    method: Method,
    content_type: String,
    accept: String,
    manager: String,
    params: BTreeMap<String, String>,
    body: Bytes,
}

fn dispatch(state: &State, target: &Target, path: &str, call: &Call) -> Response<Body> {
    let Call {
        method,
        content_type,
        accept,
        manager,
        params,
        body,
    } = call;
    let table = table::wanted(accept);
    let parsed = || serde_json::from_slice::<Value>(body);
    let name = target.name.clone();
    match (method.clone(), name, target.subresource.as_deref()) {
        (Method::GET, None, None)
            if matches!(params.get("watch").map(String::as_str), Some("true" | "1")) =>
        {
            watch(state, target, params)
        }
        (Method::GET, None, None) => list(state, target, params, table),
        (Method::GET, Some(name), None | Some("status")) => {
            get(state, target, &name, table.then_some(params))
        }
        (Method::POST, None, None) => match parsed() {
            Ok(obj) => create(state, target, obj, manager),
            Err(e) => status_error(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
        },
        (Method::PUT, Some(name), sub @ (None | Some("status"))) => match parsed() {
            Ok(obj) => replace(state, target, &name, obj, sub.is_some(), manager),
            Err(e) => status_error(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
        },
        (Method::PATCH, Some(name), sub @ (None | Some("status"))) => {
            let status = sub.is_some();
            let kind = content_type.split(';').next().unwrap_or_default().trim();
            if kind == "application/apply-patch+yaml" {
                let Some(manager) = params.get("fieldManager") else {
                    return status_error(
                        StatusCode::BAD_REQUEST,
                        "BadRequest",
                        "fieldManager: Required value: is required for apply patch".into(),
                    );
                };
                let force = params.get("force").is_some_and(|f| f == "true");
                let applied = serde_json::from_slice::<Value>(body).or_else(|_| {
                    serde_saphyr::from_slice::<Value>(body).map_err(|e| e.to_string())
                });
                return match applied {
                    Ok(applied) => {
                        server_side_apply(state, target, &name, &applied, status, manager, force)
                    }
                    Err(e) => status_error(StatusCode::BAD_REQUEST, "BadRequest", e.to_string()),
                };
            }
            let patch = match parsed() {
                Ok(patch) => patch,
                Err(e) => {
                    return status_error(StatusCode::BAD_REQUEST, "BadRequest", e.to_string())
                }
            };
            match kind {
                "application/merge-patch+json" => {
                    merge_patch(state, target, &name, &patch, status, manager)
                }
                "application/json-patch+json" => {
                    json_patch(state, target, &name, &patch, status, manager)
                }
                _ => status_error(
                    StatusCode::UNSUPPORTED_MEDIA_TYPE,
                    "UnsupportedMediaType",
                    format!("patch type {content_type} is not supported by the test API server"),
                ),
            }
        }
        (Method::DELETE, Some(name), None) => delete(state, target, &name),
        (m, _, _) => status_error(
            StatusCode::METHOD_NOT_ALLOWED,
            "MethodNotAllowed",
            format!("{m} {path} is not supported by the test API server"),
        ),
    }
}

fn key(target: &Target, name: &str) -> Key {
    Key {
        api: target.api.clone(),
        plural: target.plural.clone(),
        namespace: target.namespace.clone().unwrap_or_default(),
        name: name.to_string(),
    }
}

fn not_found(target: &Target, name: &str) -> Response<Body> {
    status_error(
        StatusCode::NOT_FOUND,
        "NotFound",
        format!(
            "{}.{} \"{name}\" not found",
            target.plural,
            api_version(&target.api)
        ),
    )
}

/// One object, or (`table`: the request's parameters) its Table.
fn get(
    state: &State,
    target: &Target,
    name: &str,
    table: Option<&BTreeMap<String, String>>,
) -> Response<Body> {
    let inner = lock(state);
    let Some(obj) = inner.objects.get(&key(target, name)) else {
        return not_found(target, name);
    };
    match table {
        Some(params) => table::respond(state, target, &[obj], &inner.rv.to_string(), params),
        None => full(StatusCode::OK, obj),
    }
}

/// A number unlikely to repeat across servers: the time's nanoseconds and
/// the process id.
fn uid_epoch() -> u32 {
    static SERVERS: AtomicUsize = AtomicUsize::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    nanos ^ std::process::id().rotate_left(16) ^ (SERVERS.fetch_add(1, Ordering::Relaxed) as u32)
}

fn filter(target: &Target, params: &BTreeMap<String, String>) -> Filter {
    Filter {
        api: target.api.clone(),
        plural: target.plural.clone(),
        namespace: target.namespace.clone(),
        labels: parse_selector(
            params
                .get("labelSelector")
                .map(String::as_str)
                .unwrap_or_default(),
        ),
        fields: parse_selector(
            params
                .get("fieldSelector")
                .map(String::as_str)
                .unwrap_or_default(),
        ),
    }
}

fn list(
    state: &State,
    target: &Target,
    params: &BTreeMap<String, String>,
    table: bool,
) -> Response<Body> {
    let f = filter(target, params);
    let inner = lock(state);
    let items: Vec<&Value> = inner
        .objects
        .iter()
        .filter(|(k, v)| f.matches(&k.api, &k.plural, &k.namespace, v))
        .map(|(_, v)| v)
        .collect();
    if table {
        return table::respond(state, target, &items, &inner.rv.to_string(), params);
    }
    let body = json!({
        "apiVersion": api_version(&target.api),
        "kind": format!("{}List", kind_of(&target.plural)),
        "metadata": {"resourceVersion": inner.rv.to_string()},
        "items": items,
    });
    full(StatusCode::OK, &body)
}

fn watch(state: &State, target: &Target, params: &BTreeMap<String, String>) -> Response<Body> {
    let f = filter(target, params);
    let since: Option<u64> = params
        .get("resourceVersion")
        .and_then(|rv| rv.parse().ok())
        .filter(|rv| *rv > 0);
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|t| t.parse().ok())
        .map_or(Duration::from_secs(290), Duration::from_secs);
    let (initial, mut rx) = {
        let inner = lock(state);
        let initial: Vec<Value> = match since {
            Some(rv) => inner
                .history
                .iter()
                .filter(|c| c.rv > rv && f.matches(&c.api, &c.plural, &c.namespace, &c.object))
                .map(|c| json!({"type": c.kind, "object": c.object}))
                .collect(),
            None => inner
                .objects
                .iter()
                .filter(|(k, v)| f.matches(&k.api, &k.plural, &k.namespace, v))
                .map(|(_, v)| json!({"type": "ADDED", "object": v}))
                .collect(),
        };
        (initial, state.changes.subscribe())
    };
    let (tx, body_rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(Bytes::from(format!("{v}\n"))).await.is_ok() }
        };
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        for ev in initial {
            if !send(ev).await {
                return;
            }
        }
        loop {
            tokio::select! {
                () = &mut deadline => return,
                // The client went away: end the watch now, not at the next change.
                () = tx.closed() => return,
                change = rx.recv() => match change {
                    Ok(c) if f.matches(&c.api, &c.plural, &c.namespace, &c.object) => {
                        if !send(json!({"type": c.kind, "object": c.object})).await {
                            return;
                        }
                    }
                    Ok(_) => {}
                    // Too slow a reader: end the watch; the client lists again.
                    Err(_) => return,
                },
            }
        }
    });
    let stream = futures::stream::unfold(body_rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, Infallible>(Frame::data(b)), rx))
    });
    let mut resp = Response::new(BodyExt::boxed_unsync(StreamBody::new(stream)));
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    resp
}

fn record(state: &State, inner: &mut Inner, kind: &'static str, k: &Key, object: Value) {
    let change = Arc::new(Change {
        kind,
        api: k.api.clone(),
        plural: k.plural.clone(),
        namespace: k.namespace.clone(),
        rv: inner.rv,
        object,
    });
    inner.history.push(change.clone());
    let _ = state.changes.send(change);
}

fn bump(inner: &mut Inner, obj: &mut Value) {
    inner.rv += 1;
    obj["metadata"]["resourceVersion"] = json!(inner.rv.to_string());
}

/// The 422 response for an object admission refuses.
/// The refusal of the policies in force, else of the schema validator.
fn admit(
    state: &State,
    api: &str,
    plural: &str,
    obj: &Value,
    old: Option<&Value>,
) -> Option<Response<Body>> {
    if let Some(refused) = policy::check(state, api, plural, Some(obj), old) {
        return Some(refused);
    }
    let validator = state.validator.as_ref()?;
    validator(plural, obj, old)
        .err()
        .map(|m| status_error(StatusCode::UNPROCESSABLE_ENTITY, "Invalid", m))
}

fn create(state: &State, target: &Target, mut obj: Value, manager: &str) -> Response<Body> {
    let namespace = match target.namespace.clone() {
        Some(ns) if !cluster_scoped(&target.plural) => Some(ns),
        None if cluster_scoped(&target.plural) => None,
        _ => {
            return status_error(
                StatusCode::NOT_FOUND,
                "NotFound",
                format!("{} cannot be created at this scope", target.plural),
            )
        }
    };
    let mut inner = lock(state);
    let name = match (
        obj["metadata"]["name"].as_str(),
        obj["metadata"]["generateName"].as_str(),
    ) {
        (Some(n), _) => n.to_string(),
        (None, Some(prefix)) => format!("{prefix}{:05x}", inner.uids + 1),
        (None, None) => {
            return status_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.name: Required value".into(),
            )
        }
    };
    let k = key(target, &name);
    if inner.objects.contains_key(&k) {
        let message = format!(
            "{}.{} \"{name}\" already exists",
            target.plural,
            api_version(&target.api)
        );
        return status_error(StatusCode::CONFLICT, "AlreadyExists", message);
    }
    obj["apiVersion"] = json!(api_version(&target.api));
    obj["kind"] = json!(kind_of(&target.plural));
    // As kube-apiserver: the request's namespace is the object's before admission.
    if let Some(ns) = &namespace {
        obj["metadata"]["namespace"] = json!(ns);
    }
    if let Some(resp) = admit(state, &target.api, &target.plural, &obj, None) {
        return resp;
    }
    inner.uids += 1;
    let meta = &mut obj["metadata"];
    meta["name"] = json!(name);
    if let Some(namespace) = namespace {
        meta["namespace"] = json!(namespace);
    }
    meta["uid"] = json!(format!(
        "{:08x}-0000-4000-8000-{:012x}",
        inner.uid_epoch, inner.uids
    ));
    meta["creationTimestamp"] = json!(now());
    meta["generation"] = json!(1);
    if let Some(m) = meta.as_object_mut() {
        m.remove("deletionTimestamp");
    }
    if has_status(&target.plural) {
        if let Some(o) = obj.as_object_mut() {
            o.remove("status");
        }
    }
    normalize(&mut obj);
    let writer = writer(target, false, manager);
    let managers = ssa::record_update(
        &json!({}),
        &obj,
        &[],
        &state.schema(&target.plural),
        &writer,
    );
    obj["metadata"]["managedFields"] = ssa::render(&managers);
    inner.managed.insert(k.clone(), managers);
    bump(&mut inner, &mut obj);
    inner.objects.insert(k.clone(), obj.clone());
    record(state, &mut inner, "ADDED", &k, obj.clone());
    // Kubernetes' garbage collector deletes a dependent whose owner is gone
    // (created by a reconcile that raced the owner's deletion, say).
    let orphaned = obj["metadata"]["ownerReferences"]
        .as_array()
        .is_some_and(|refs| {
            refs.iter().any(|r| {
                !inner
                    .objects
                    .iter()
                    .any(|(ok, o)| ok.namespace == k.namespace && o["metadata"]["uid"] == r["uid"])
            })
        });
    if orphaned {
        delete_key(state, &mut inner, &k);
    }
    full(StatusCode::CREATED, &obj)
}

fn conflict(target: &Target, name: &str) -> Response<Body> {
    let message = format!(
        "Operation cannot be fulfilled on {}.{} \"{name}\": the object has been modified; please apply your changes to the latest version and try again",
        target.plural,
        api_version(&target.api)
    );
    status_error(StatusCode::CONFLICT, "Conflict", message)
}

/// Drops what kube-apiserver does not store: an empty finalizer list.
fn normalize(obj: &mut Value) {
    if obj["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|a| a.is_empty())
    {
        if let Some(m) = obj["metadata"].as_object_mut() {
            m.remove("finalizers");
        }
    }
}

/// Who writes, and the field owners after the write when they are already
/// known (server-side apply); otherwise they are derived from the change.
struct Write {
    writer: Writer,
    managers: Option<Vec<Manager>>,
}

/// Writes `new` over `stored` (the caller has merged what the endpoint may change).
fn update(
    state: &State,
    inner: &mut Inner,
    k: &Key,
    stored: &Value,
    mut new: Value,
    write: Write,
) -> Response<Body> {
    normalize(&mut new);
    for field in [
        "uid",
        "creationTimestamp",
        "deletionTimestamp",
        "namespace",
        "name",
        "generation",
        "resourceVersion",
        "managedFields",
    ] {
        match stored["metadata"].get(field) {
            Some(v) => new["metadata"][field] = v.clone(),
            None => {
                if let Some(m) = new["metadata"].as_object_mut() {
                    m.remove(field);
                }
            }
        }
    }
    if stored["metadata"]["deletionTimestamp"].is_string() {
        let old: Vec<&Value> = stored["metadata"]["finalizers"]
            .as_array()
            .map(|a| a.iter().collect())
            .unwrap_or_default();
        let added = new["metadata"]["finalizers"]
            .as_array()
            .is_some_and(|a| a.iter().any(|f| !old.contains(&f)));
        if added {
            return status_error(
                StatusCode::UNPROCESSABLE_ENTITY,
                "Invalid",
                "metadata.finalizers: Forbidden: no new finalizers can be added if the object is being deleted".into(),
            );
        }
    }
    if let Some(resp) = admit(state, &k.api, &k.plural, &new, Some(stored)) {
        return resp;
    }
    if new == *stored {
        return full(StatusCode::OK, stored);
    }
    let old_managers = inner.managed.get(k).cloned().unwrap_or_default();
    let managers = write.managers.unwrap_or_else(|| {
        ssa::record_update(
            stored,
            &new,
            &old_managers,
            &state.schema(&k.plural),
            &write.writer,
        )
    });
    new["metadata"]["managedFields"] = ssa::render(&managers);
    inner.managed.insert(k.clone(), managers);
    if new.get("spec") != stored.get("spec") {
        let generation = stored["metadata"]["generation"].as_i64().unwrap_or(1) + 1;
        new["metadata"]["generation"] = json!(generation);
    }
    bump(inner, &mut new);
    let finalizers_empty = new["metadata"]["finalizers"]
        .as_array()
        .is_none_or(|a| a.is_empty());
    if new["metadata"]["deletionTimestamp"].is_string() && finalizers_empty {
        remove(state, inner, k);
        return full(StatusCode::OK, &new);
    }
    inner.objects.insert(k.clone(), new.clone());
    record(state, inner, "MODIFIED", k, new.clone());
    full(StatusCode::OK, &new)
}

fn stale(body_rv: Option<&str>, stored: &Value) -> bool {
    body_rv.is_some_and(|rv| {
        !rv.is_empty() && Some(rv) != stored["metadata"]["resourceVersion"].as_str()
    })
}

fn replace(
    state: &State,
    target: &Target,
    name: &str,
    body: Value,
    status: bool,
    manager: &str,
) -> Response<Body> {
    let k = key(target, name);
    let mut inner = lock(state);
    let Some(stored) = inner.objects.get(&k).cloned() else {
        return not_found(target, name);
    };
    if stale(body["metadata"]["resourceVersion"].as_str(), &stored) {
        return conflict(target, name);
    }
    let new = split_status(&stored, body, status, &target.plural);
    let write = updater(target, status, manager);
    update(state, &mut inner, &k, &stored, new, write)
}

fn writer(target: &Target, status: bool, manager: &str) -> Writer {
    Writer {
        manager: manager.to_string(),
        api_version: api_version(&target.api),
        time: now(),
        scope: scope(&target.plural, status),
    }
}

fn updater(target: &Target, status: bool, manager: &str) -> Write {
    Write {
        writer: writer(target, status, manager),
        managers: None,
    }
}

/// The main resource cannot change `status`; `/status` can change only `status`.
fn split_status(stored: &Value, mut body: Value, status: bool, plural: &str) -> Value {
    if status {
        let mut new = stored.clone();
        new["status"] = body.get("status").cloned().unwrap_or(Value::Null);
        if new["status"].is_null() {
            if let Some(o) = new.as_object_mut() {
                o.remove("status");
            }
        }
        new
    } else {
        if has_status(plural) {
            match stored.get("status") {
                Some(s) => body["status"] = s.clone(),
                None => {
                    if let Some(o) = body.as_object_mut() {
                        o.remove("status");
                    }
                }
            }
        }
        body
    }
}

fn delete(state: &State, target: &Target, name: &str) -> Response<Body> {
    let k = key(target, name);
    let mut inner = lock(state);
    if let Some(stored) = inner.objects.get(&k) {
        if let Some(refused) = policy::check(state, &target.api, &target.plural, None, Some(stored))
        {
            return refused;
        }
    }
    match delete_key(state, &mut inner, &k) {
        Some(obj) => full(StatusCode::OK, &obj),
        None => not_found(target, name),
    }
}

/// Deletes (or, with finalizers, marks for deletion) one object.
fn delete_key(state: &State, inner: &mut Inner, k: &Key) -> Option<Value> {
    let mut obj = inner.objects.get(k).cloned()?;
    let has_finalizers = obj["metadata"]["finalizers"]
        .as_array()
        .is_some_and(|a| !a.is_empty());
    if !has_finalizers {
        remove(state, inner, k);
        return Some(obj);
    }
    if !obj["metadata"]["deletionTimestamp"].is_string() {
        obj["metadata"]["deletionTimestamp"] = json!(now());
        obj["metadata"]["deletionGracePeriodSeconds"] = json!(0);
        bump(inner, &mut obj);
        inner.objects.insert(k.clone(), obj.clone());
        record(state, inner, "MODIFIED", k, obj.clone());
    }
    Some(obj)
}

/// Removes an object for good, then deletes its dependents (background propagation).
fn remove(state: &State, inner: &mut Inner, k: &Key) {
    let Some(mut obj) = inner.objects.remove(k) else {
        return;
    };
    inner.managed.remove(k);
    bump(inner, &mut obj);
    let uid = obj["metadata"]["uid"].clone();
    record(state, inner, "DELETED", k, obj);
    let dependents: Vec<Key> = inner
        .objects
        .iter()
        .filter(|(dk, v)| {
            dk.namespace == k.namespace
                && v["metadata"]["ownerReferences"]
                    .as_array()
                    .is_some_and(|refs| refs.iter().any(|r| r["uid"] == uid))
        })
        .map(|(dk, _)| dk.clone())
        .collect();
    for dk in dependents {
        delete_key(state, inner, &dk);
    }
}
