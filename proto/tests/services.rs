//! The generated ttrpc code end to end: a sync and an async `Agent` server
//! reached through a fake VMM's vsock handshake, and the async `Twig` and
//! `Node` services over a Unix socket.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::IntoRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use twig_proto::{agent, twig, vsock, AGENT_VSOCK_PORT};

const T: Duration = Duration::from_secs(10);
const T_NS: i64 = 10_000_000_000;

fn copy(mut from: UnixStream, mut to: UnixStream) {
    let mut buf = [0u8; 8192];
    while let Ok(n) = from.read(&mut buf) {
        if n == 0 || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Both);
}

/// A fake VMM: accepts one connection on `uds`, checks the request is for
/// the agent's port, connects to `guest` and splices the two streams.
fn forwarding_vmm(uds: &Path, guest: PathBuf) -> JoinHandle<()> {
    let listener = UnixListener::bind(uds).unwrap();
    std::thread::spawn(move || {
        let (mut host, _) = listener.accept().unwrap();
        let mut line = String::new();
        BufReader::new(host.try_clone().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line, format!("CONNECT {AGENT_VSOCK_PORT}\n"));
        let guest = UnixStream::connect(guest).unwrap();
        host.write_all(b"OK 1073741824\n").unwrap();
        let (h, g) = (host.try_clone().unwrap(), guest.try_clone().unwrap());
        let t = std::thread::spawn(move || copy(h, g));
        copy(guest, host);
        t.join().unwrap();
    })
}

fn pong() -> agent::PingResponse {
    agent::PingResponse {
        version: "fake".to_string(),
        uptime_s: 1.5,
        ..Default::default()
    }
}

struct SyncAgent;

impl twig_proto::agent_ttrpc::Agent for SyncAgent {
    fn ping(
        &self,
        _ctx: &ttrpc::TtrpcContext,
        _req: agent::PingRequest,
    ) -> ttrpc::Result<agent::PingResponse> {
        Ok(pong())
    }
}

#[test]
fn sync_agent_through_the_vsock_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let guest = dir.path().join("agent.sock");
    let mut server = ttrpc::Server::new()
        .bind(&format!("unix://{}", guest.display()))
        .unwrap()
        .register_service(twig_proto::agent_ttrpc::create_agent(Arc::new(SyncAgent)));
    server.start().unwrap();

    let uds = dir.path().join("vsock.sock");
    let vmm = forwarding_vmm(&uds, guest);
    let stream = vsock::connect(&uds, AGENT_VSOCK_PORT, T).unwrap();
    let client = twig_proto::agent_ttrpc::AgentClient::new(
        ttrpc::Client::new(stream.into_raw_fd()).unwrap(),
    );
    let reply = client
        .ping(
            ttrpc::context::with_timeout(T_NS),
            &agent::PingRequest::new(),
        )
        .unwrap();
    assert_eq!(reply, pong());
    // Methods the server does not implement answer NOT_FOUND (ttrpc-codegen's
    // default trait methods).
    let e = client
        .stats(
            ttrpc::context::with_timeout(T_NS),
            &agent::ContainerRequest::new(),
        )
        .unwrap_err();
    assert!(
        matches!(&e, ttrpc::Error::RpcStatus(s) if s.code() == ttrpc::Code::NOT_FOUND
            && s.message() == "/twig.agent.v1.Agent/Stats is not supported"),
        "{e:?}"
    );
    drop(client);
    vmm.join().unwrap();
    server.shutdown();
}

struct AsyncAgent;

#[async_trait::async_trait]
impl twig_proto::agent_ttrpc_async::Agent for AsyncAgent {
    async fn ping(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        _req: agent::PingRequest,
    ) -> ttrpc::Result<agent::PingResponse> {
        Ok(pong())
    }
}

struct Services;

#[async_trait::async_trait]
impl twig_proto::twig_ttrpc::Twig for Services {
    async fn snapshot(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        req: twig::SnapshotRequest,
    ) -> ttrpc::Result<twig::SnapshotResponse> {
        if req.snapshot_id.is_empty() {
            return Err(ttrpc::Error::RpcStatus(ttrpc::get_status(
                ttrpc::Code::INVALID_ARGUMENT,
                "snapshot_id is empty",
            )));
        }
        Ok(twig::SnapshotResponse::new())
    }
}

#[async_trait::async_trait]
impl twig_proto::twig_ttrpc::Node for Services {
    async fn get_snapshot(
        &self,
        _ctx: &ttrpc::r#async::TtrpcContext,
        _req: twig::GetSnapshotRequest,
    ) -> ttrpc::Result<twig::GetSnapshotResponse> {
        Ok(twig::GetSnapshotResponse {
            found: true,
            ..Default::default()
        })
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_agent_twig_and_node() {
    use ttrpc::r#async::transport::Socket;

    let dir = tempfile::tempdir().unwrap();
    let guest = dir.path().join("agent.sock");
    let services = dir.path().join("twig.sock");
    let mut agent_server = ttrpc::r#async::Server::new()
        .bind(&format!("unix://{}", guest.display()))
        .unwrap()
        .register_service(twig_proto::agent_ttrpc_async::create_agent(Arc::new(
            AsyncAgent,
        )));
    agent_server.start().await.unwrap();
    let mut twig_server = ttrpc::r#async::Server::new()
        .bind(&format!("unix://{}", services.display()))
        .unwrap()
        .register_service(twig_proto::twig_ttrpc::create_twig(Arc::new(Services)))
        .register_service(twig_proto::twig_ttrpc::create_node(Arc::new(Services)));
    twig_server.start().await.unwrap();

    let uds = dir.path().join("vsock.sock");
    let vmm = forwarding_vmm(&uds, guest);
    let stream = vsock::connect_async(&uds, AGENT_VSOCK_PORT, T)
        .await
        .unwrap();
    let client = twig_proto::agent_ttrpc_async::AgentClient::new(ttrpc::r#async::Client::new(
        Socket::from(stream),
    ));
    let reply = client
        .ping(
            ttrpc::context::with_timeout(T_NS),
            &agent::PingRequest::new(),
        )
        .await
        .unwrap();
    assert_eq!(reply, pong());
    drop(client);

    let stream = tokio::net::UnixStream::connect(&services).await.unwrap();
    let raw = ttrpc::r#async::Client::new(Socket::from(stream));
    let shim = twig_proto::twig_ttrpc::TwigClient::new(raw.clone());
    let node = twig_proto::twig_ttrpc::NodeClient::new(raw);
    let e = shim
        .snapshot(
            ttrpc::context::with_timeout(T_NS),
            &twig::SnapshotRequest::new(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(&e, ttrpc::Error::RpcStatus(s) if s.code() == ttrpc::Code::INVALID_ARGUMENT
            && s.message() == "snapshot_id is empty"),
        "{e:?}"
    );
    let req = twig::SnapshotRequest {
        snapshot_id: "s1".to_string(),
        ..Default::default()
    };
    shim.snapshot(ttrpc::context::with_timeout(T_NS), &req)
        .await
        .unwrap();
    let got = node
        .get_snapshot(
            ttrpc::context::with_timeout(T_NS),
            &twig::GetSnapshotRequest::new(),
        )
        .await
        .unwrap();
    assert!(got.found);

    tokio::task::spawn_blocking(move || vmm.join().unwrap())
        .await
        .unwrap();
    agent_server.shutdown().await.unwrap();
    twig_server.shutdown().await.unwrap();
}
