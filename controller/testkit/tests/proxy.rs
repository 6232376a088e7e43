//! The test API server's `proxy` subresources of Services and Pods, against
//! backends on 127.0.0.1 that answer with what they were asked: resolution
//! through Endpoints by port name and number, endpoints taken in turn,
//! the pod's IP and port, kube-apiserver's 404, 503 and 403 Statuses, and
//! the real kubectl's `get --raw` through it.

use std::convert::Infallible;

use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use k8s_openapi::api::core::v1::{Endpoints, Pod, Service};
use kube::api::{Api, PostParams};
use kube::core::Status;
use kube::Client;
use serde_json::json;
use twig_controller_testkit::kube_tools::Kubectl;
use twig_controller_testkit::{api_server, NS};

/// A backend on 127.0.0.1 answering `NAME GET /path?query` as text/plain.
struct Backend {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn backend(name: &'static str) -> Backend {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind backend");
    let port = listener.local_addr().expect("addr").port();
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<_>| async move {
                    let text = format!("{name} {} {}", req.method(), req.uri());
                    let mut resp = Response::new(Full::new(Bytes::from(text)));
                    resp.headers_mut().insert(
                        hyper::header::CONTENT_TYPE,
                        hyper::header::HeaderValue::from_static("text/plain; version=0.0.4"),
                    );
                    Ok::<_, Infallible>(resp)
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Backend { port, task }
}

async fn create_service(client: &Client, name: &str, ports: serde_json::Value) {
    let service: Service = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": ports},
    }))
    .expect("service");
    Api::<Service>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &service)
        .await
        .expect("create service");
}

async fn create_endpoints(client: &Client, name: &str, subsets: serde_json::Value) {
    let endpoints: Endpoints = serde_json::from_value(json!({
        "metadata": {"name": name},
        "subsets": subsets,
    }))
    .expect("endpoints");
    Api::<Endpoints>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &endpoints)
        .await
        .expect("create endpoints");
}

async fn get(client: &Client, path: &str) -> Result<String, Box<Status>> {
    let request = http::Request::get(path).body(Vec::new()).expect("request");
    client.request_text(request).await.map_err(|e| match e {
        kube::Error::Api(status) => status,
        other => panic!("GET {path}: not an API error: {other}"),
    })
}

fn assert_status(result: Result<String, Box<Status>>, code: u16, reason: &str, message: &str) {
    let status = result.expect_err("an error Status");
    assert_eq!(
        (status.code, status.reason.as_str()),
        (code, reason),
        "{status:?}"
    );
    assert!(status.message.contains(message), "{status:?}");
}

fn proxy(target: &str, rest: &str) -> String {
    format!("/api/v1/namespaces/{NS}/{target}/proxy{rest}")
}

#[tokio::test(flavor = "multi_thread")]
async fn service_proxy_resolves_endpoints_by_port_name_and_number() {
    let server = api_server().await;
    let client = server.client();
    let a = backend("a").await;
    let web = backend("web").await;
    create_service(
        &client,
        "ctl",
        json!([{"name": "metrics", "port": 9090}, {"name": "http", "port": 80}]),
    )
    .await;
    create_endpoints(
        &client,
        "ctl",
        json!([{
            "addresses": [{"ip": "127.0.0.1", "nodeName": "node-a"}],
            "notReadyAddresses": [{"ip": "127.0.0.9"}],
            "ports": [{"name": "metrics", "port": a.port}, {"name": "http", "port": web.port}],
        }]),
    )
    .await;
    assert_eq!(
        get(&client, &proxy("services/ctl:metrics", "/metrics?x=1")).await,
        Ok("a GET /metrics?x=1".to_string())
    );
    assert_eq!(
        get(&client, &proxy("services/ctl:9090", "/healthz")).await,
        Ok("a GET /healthz".to_string()),
        "a port number is the Service port of that number"
    );
    assert_eq!(
        get(&client, &proxy("services/ctl:http", "")).await,
        Ok("web GET /".to_string())
    );
    assert_status(
        get(&client, &proxy("services/ctl:1234", "/metrics")).await,
        503,
        "ServiceUnavailable",
        "no service port 1234 found for service \"ctl\"",
    );
    assert_status(
        get(&client, &proxy("services/ctl:other", "/metrics")).await,
        503,
        "ServiceUnavailable",
        "no endpoints available for service \"ctl:other\"",
    );
    assert_status(
        get(&client, &proxy("services/nope:metrics", "/metrics")).await,
        404,
        "NotFound",
        "services \"nope\" not found",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn service_proxy_takes_endpoints_in_turn_and_says_when_there_are_none() {
    let server = api_server().await;
    let client = server.client();
    let a = backend("a").await;
    let b = backend("b").await;
    create_service(&client, "ctl", json!([{"name": "metrics", "port": 9090}])).await;
    create_endpoints(
        &client,
        "ctl",
        json!([
            {"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "metrics", "port": a.port}]},
            {"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "metrics", "port": b.port}]},
        ]),
    )
    .await;
    let mut answers = std::collections::BTreeSet::new();
    for _ in 0..4 {
        let text = get(&client, &proxy("services/ctl:metrics", "/m"))
            .await
            .expect("proxied");
        answers.insert(text);
    }
    assert_eq!(
        answers,
        ["a GET /m", "b GET /m"].map(String::from).into(),
        "every endpoint answers in turn, as kube-apiserver's random pick would"
    );

    create_service(&client, "empty", json!([{"name": "metrics", "port": 9090}])).await;
    create_endpoints(&client, "empty", json!([])).await;
    assert_status(
        get(&client, &proxy("services/empty:metrics", "/metrics")).await,
        503,
        "ServiceUnavailable",
        "no endpoints available for service \"empty:metrics\"",
    );
    create_service(
        &client,
        "unlisted",
        json!([{"name": "metrics", "port": 9090}]),
    )
    .await;
    assert_status(
        get(&client, &proxy("services/unlisted:metrics", "/metrics")).await,
        404,
        "NotFound",
        "endpoints \"unlisted\" not found",
    );

    // An endpoint whose backend is gone: kube-apiserver's 503.
    let port = b.port;
    drop(b);
    create_service(&client, "gone", json!([{"port": 9090}])).await;
    create_endpoints(
        &client,
        "gone",
        json!([{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"port": port}]}]),
    )
    .await;
    assert_status(
        get(&client, &proxy("services/gone", "/metrics")).await,
        503,
        "ServiceUnavailable",
        &format!("error trying to reach service: 127.0.0.1:{port}: "),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn pod_proxy_reaches_the_pods_ip_and_port() {
    let server = api_server().await;
    let client = server.client();
    let a = backend("a").await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": "ctl-x"},
        "spec": {"containers": [{"name": "c", "ports": [{"containerPort": a.port}]}]},
    }))
    .expect("pod");
    let created = pods
        .create(&PostParams::default(), &pod)
        .await
        .expect("create pod");
    assert_status(
        get(&client, &proxy("pods/ctl-x", "/metrics")).await,
        503,
        "ServiceUnavailable",
        "pod \"ctl-x\" has no IP address",
    );
    let mut running = created.clone();
    running.status = serde_json::from_value(json!({"podIP": "127.0.0.1"})).expect("status");
    pods.replace_status("ctl-x", &PostParams::default(), &running)
        .await
        .expect("pod IP");
    assert_eq!(
        get(
            &client,
            &proxy(&format!("pods/ctl-x:{}", a.port), "/metrics")
        )
        .await,
        Ok("a GET /metrics".to_string())
    );
    assert_eq!(
        get(&client, &proxy("pods/ctl-x", "/metrics")).await,
        Ok("a GET /metrics".to_string()),
        "no port: the first container port"
    );
    assert_status(
        get(&client, &proxy("pods/nope:80", "/metrics")).await,
        404,
        "NotFound",
        "pods \"nope\" not found",
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_forbidden_proxy_is_kube_apiservers_403_and_kubectl_reads_through_it() {
    let server = api_server().await;
    let client = server.client();
    let a = backend("a").await;
    create_service(&client, "ctl", json!([{"name": "metrics", "port": 9090}])).await;
    create_endpoints(
        &client,
        "ctl",
        json!([{"addresses": [{"ip": "127.0.0.1"}], "ports": [{"name": "metrics", "port": a.port}]}]),
    )
    .await;
    let kubectl = Kubectl::new(server.addr);
    let path = proxy("services/ctl:metrics", "/metrics");
    assert_eq!(kubectl.ok(&["get", "--raw", &path]).await, "a GET /metrics");

    server.forbid("get", "", "services/proxy");
    assert_status(
        get(&server.client_as("alice"), &path).await,
        403,
        "Forbidden",
        "services \"ctl:metrics\" is forbidden: User \"alice\" cannot get resource \
         \"services/proxy\" in API group \"\" in the namespace \"default\"",
    );
    let out = kubectl.run(&["get", "--raw", &path]).await;
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("Error from server (Forbidden)")
            && stderr.contains("User \"system:anonymous\" cannot get resource \"services/proxy\""),
        "{stderr}"
    );
    assert!(
        server
            .accesses("alice")
            .iter()
            .any(|a| a.verb == "get" && a.resource == "services/proxy"),
        "the refused access is recorded"
    );
}
