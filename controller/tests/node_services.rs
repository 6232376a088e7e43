//! The real implementations behind the controller's traits: the ttrpc clients
//! against a ttrpc server over a Unix socket, and the containerd state lookup.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use k8s_openapi::api::core::v1::Pod;
use kube::api::ObjectMeta;
use twig_controller::crd::{SandboxTemplateSpec, SnapshotMode};
use twig_controller::sandbox::{ContainerdLocator, LocateError, SandboxLocator};
use twig_controller::shim::{
    BuildIn, NetworkCounter, NodeService, Sandbox, ShimError, SnapshotInfo, StoreUsage, TtrpcNode,
    TtrpcShim, TwigShim,
};
use twig_net::EgressPolicy;
use twig_proto::{twig as pb, twig_ttrpc as rpc};

/// A minimal shim and node daemon: remembers what it was asked.
#[derive(Default)]
struct Server {
    requests: Mutex<Vec<String>>,
    snapshots: Mutex<BTreeMap<String, pb::SnapshotInfo>>,
    last_rollback: Mutex<String>,
    /// The policy in force as the JSON last set (sandbox `sb-1` has a network path).
    egress_policy: Mutex<String>,
    /// The registry logins of the last EnsureTemplate.
    /// The last EnsureTemplate's build Pod UID (`None`: unset).
    build_pod: Mutex<Option<String>>,
}

fn status(code: ttrpc::Code, message: &str) -> ttrpc::Error {
    ttrpc::Error::RpcStatus(ttrpc::get_status(code, message))
}

#[async_trait]
impl rpc::Twig for Server {
    async fn snapshot(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::SnapshotRequest,
    ) -> ttrpc::Result<pb::SnapshotResponse> {
        self.requests.lock().expect("lock").push(format!(
            "snapshot {} {} full={}",
            req.sandbox_id, req.snapshot_id, req.full
        ));
        if req.sandbox_id != "sb-1" {
            return Err(status(ttrpc::Code::NOT_FOUND, "no such sandbox"));
        }
        let mut snaps = self.snapshots.lock().expect("lock");
        let parent = if req.full {
            String::new()
        } else {
            snaps.keys().last().cloned().unwrap_or_default()
        };
        let info = pb::SnapshotInfo {
            snapshot_id: req.snapshot_id.clone(),
            parent_id: parent,
            size_bytes: 1 << 27,
            written_bytes: 1 << 12,
            memory_bytes: 1 << 26,
            disk_bytes: 1 << 20,
            restore_bytes: (1 << 27) + (1 << 30),
            ..Default::default()
        };
        snaps.insert(req.snapshot_id, info.clone());
        Ok(pb::SnapshotResponse {
            snapshot: Some(info).into(),
            ..Default::default()
        })
    }

    async fn rollback(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::RollbackRequest,
    ) -> ttrpc::Result<pb::RollbackResponse> {
        if !self
            .snapshots
            .lock()
            .expect("lock")
            .contains_key(&req.snapshot_id)
        {
            return Err(status(
                ttrpc::Code::FAILED_PRECONDITION,
                "snapshot is not in this sandbox's lineage",
            ));
        }
        *self.last_rollback.lock().expect("lock") = req.operation_id;
        Ok(pb::RollbackResponse::default())
    }

    async fn stats(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        _: pb::StatsRequest,
    ) -> ttrpc::Result<pb::StatsResponse> {
        Ok(pb::StatsResponse {
            snapshots: self
                .snapshots
                .lock()
                .expect("lock")
                .values()
                .cloned()
                .collect(),
            last_rollback_operation_id: self.last_rollback.lock().expect("lock").clone(),
            network: Some(pb::PodNetworkStats {
                egress_policy: self.egress_policy.lock().expect("lock").clone(),
                counters: vec![pb::NetworkCounter {
                    reason: "deny_rule".into(),
                    dropped: true,
                    packets: 3,
                    bytes: 180,
                    ..Default::default()
                }],
                ..Default::default()
            })
            .into(),
            ..Default::default()
        })
    }

    async fn set_egress_policy(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::SetEgressPolicyRequest,
    ) -> ttrpc::Result<pb::SetEgressPolicyResponse> {
        self.requests
            .lock()
            .expect("lock")
            .push(format!("policy {} {:?}", req.sandbox_id, req.egress_policy));
        if req.sandbox_id != "sb-1" {
            return Err(status(
                ttrpc::Code::FAILED_PRECONDITION,
                "the pod has no network path",
            ));
        }
        let json = match req.egress_policy.as_str() {
            "" => serde_json::to_string(&EgressPolicy::default()).expect("json"),
            json => json.to_string(),
        };
        *self.egress_policy.lock().expect("lock") = json;
        Ok(pb::SetEgressPolicyResponse::default())
    }
}

#[async_trait]
impl rpc::Node for Server {
    async fn delete_snapshot(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::DeleteSnapshotRequest,
    ) -> ttrpc::Result<pb::DeleteSnapshotResponse> {
        self.snapshots
            .lock()
            .expect("lock")
            .remove(&req.snapshot_id);
        Ok(pb::DeleteSnapshotResponse::default())
    }

    async fn get_snapshot(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::GetSnapshotRequest,
    ) -> ttrpc::Result<pb::GetSnapshotResponse> {
        let snaps = self.snapshots.lock().expect("lock");
        let found = snaps.get(&req.snapshot_id).cloned();
        Ok(pb::GetSnapshotResponse {
            found: found.is_some(),
            snapshot: found.into(),
            ..Default::default()
        })
    }

    async fn ensure_template(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::EnsureTemplateRequest,
    ) -> ttrpc::Result<pb::EnsureTemplateResponse> {
        self.requests.lock().expect("lock").push(format!(
            "template {} {} {}x{} {:?} policy={:?}",
            req.name, req.image, req.vcpus, req.memory_mib, req.command, req.egress_policy
        ));
        let pod = req.build_pod.as_ref().map(|p| p.uid.clone());
        *self.build_pod.lock().expect("lock") = pod.clone();
        Ok(pb::EnsureTemplateResponse {
            ready: false,
            message: "booting".into(),
            needs_build_pod: pod.as_deref() == Some(""),
            failed: pod.as_deref() == Some("spent"),
            ..Default::default()
        })
    }

    async fn get_store_usage(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        _: pb::GetStoreUsageRequest,
    ) -> ttrpc::Result<pb::GetStoreUsageResponse> {
        Ok(pb::GetStoreUsageResponse {
            allocated_bytes: 5 << 20,
            capacity_bytes: 10 << 30,
            free_bytes: 7 << 30,
            snapshots: self.snapshots.lock().expect("lock").len() as u64,
            templates: 1,
            ..Default::default()
        })
    }
}

/// A node daemon with the garbage collector: deletes every snapshot it
/// holds that is not referenced, and remembers what it retained.
#[derive(Default)]
struct CollectingNode {
    snapshots: Mutex<BTreeMap<String, u64>>,
    requests: Mutex<Vec<String>>,
}

#[async_trait]
impl rpc::Node for CollectingNode {
    async fn collect_garbage(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::CollectGarbageRequest,
    ) -> ttrpc::Result<pb::CollectGarbageResponse> {
        self.requests.lock().expect("lock").push(format!(
            "gc {:?} grace={}",
            req.referenced, req.grace_seconds
        ));
        let mut snaps = self.snapshots.lock().expect("lock");
        let doomed: Vec<String> = snaps
            .keys()
            .filter(|id| !req.referenced.contains(id))
            .cloned()
            .collect();
        let reclaimed_bytes = doomed.iter().filter_map(|id| snaps.remove(id)).sum();
        Ok(pb::CollectGarbageResponse {
            deleted: doomed,
            reclaimed_bytes,
            ..Default::default()
        })
    }

    async fn retain_snapshot(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::RetainSnapshotRequest,
    ) -> ttrpc::Result<pb::RetainSnapshotResponse> {
        self.requests
            .lock()
            .expect("lock")
            .push(format!("retain {}", req.snapshot_id));
        Ok(pb::RetainSnapshotResponse::default())
    }

    async fn export_snapshot(
        &self,
        _: &ttrpc::r#async::TtrpcContext,
        req: pb::ExportSnapshotRequest,
    ) -> ttrpc::Result<pb::ExportSnapshotResponse> {
        self.requests.lock().expect("lock").push(format!(
            "export {} to {} for {}",
            req.snapshot_id, req.reference, req.namespace
        ));
        if req.reference.starts_with("down.example") {
            return Err(status(
                ttrpc::Code::UNAVAILABLE,
                "registry down.example: refused",
            ));
        }
        Ok(pb::ExportSnapshotResponse {
            digest: format!("sha256:{}", "ab".repeat(32)),
            bytes_uploaded: 4096,
            snapshots_pushed: 1,
            snapshots_present: 2,
            ..Default::default()
        })
    }
}

/// `TtrpcNode`'s CollectGarbage, RetainSnapshot and ExportSnapshot against a daemon that
/// serves them, and against one that predates them (ttrpc answers
/// NOT_FOUND for a method it does not serve, which the reconcilers take as
/// "nothing to collect, nothing to mark").
#[tokio::test]
async fn ttrpc_node_client_collects_garbage_and_retains() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Arc::new(CollectingNode::default());
    server
        .snapshots
        .lock()
        .expect("lock")
        .extend([("kept".to_string(), 10), ("orphan".to_string(), 4096)]);
    let address = format!("unix://{}", dir.path().join("node.sock").display());
    let mut ttrpc_server = ttrpc::r#async::Server::new()
        .bind(&address)
        .expect("bind ttrpc")
        .register_service(rpc::create_node(server.clone()));
    ttrpc_server.start().await.expect("start ttrpc");
    let node = TtrpcNode {
        address,
        timeout: Duration::from_secs(10),
    };
    let c = node
        .collect_garbage(vec!["kept".into()], Duration::from_secs(600))
        .await
        .expect("CollectGarbage");
    assert_eq!(c.deleted, ["orphan"]);
    assert_eq!(c.reclaimed_bytes, 4096);
    node.retain_snapshot("kept").await.expect("RetainSnapshot");
    let exported = node
        .export_snapshot("kept", "registry.example/twig/ns/s:uid-1", "ns")
        .await
        .expect("ExportSnapshot");
    assert_eq!(
        (
            exported.digest.len(),
            exported.bytes_uploaded,
            exported.snapshots_present
        ),
        (71, 4096, 2)
    );
    // The registry unreachable: retried, as any UNAVAILABLE.
    let e = node
        .export_snapshot("kept", "down.example/twig/ns/s:uid-1", "ns")
        .await
        .expect_err("unavailable");
    assert!(matches!(e, ShimError::Unavailable { .. }), "{e:?}");
    assert_eq!(
        *server.requests.lock().expect("lock"),
        [
            "gc [\"kept\"] grace=600",
            "retain kept",
            "export kept to registry.example/twig/ns/s:uid-1 for ns",
            "export kept to down.example/twig/ns/s:uid-1 for ns",
        ]
    );

    // A daemon without them.
    let old_dir = tempfile::tempdir().expect("tempdir");
    let (address, _old) = serve(&old_dir, Arc::new(Server::default())).await;
    let old = TtrpcNode {
        address,
        timeout: Duration::from_secs(10),
    };
    let e = old
        .collect_garbage(Vec::new(), Duration::from_secs(600))
        .await
        .expect_err("not served");
    assert!(matches!(e, ShimError::NotFound(_)), "{e:?}");
    let e = old.retain_snapshot("x").await.expect_err("not served");
    assert!(matches!(e, ShimError::NotFound(_)), "{e:?}");
    let e = old
        .export_snapshot("x", "registry.example/twig/ns/s:u", "ns")
        .await
        .expect_err("not served");
    assert!(matches!(e, ShimError::NotFound(_)), "{e:?}");
}

async fn serve(dir: &tempfile::TempDir, server: Arc<Server>) -> (String, ttrpc::r#async::Server) {
    let address = format!("unix://{}", dir.path().join("shim.sock").display());
    let mut ttrpc_server = ttrpc::r#async::Server::new()
        .bind(&address)
        .expect("bind ttrpc")
        .register_service(rpc::create_twig(server.clone()))
        .register_service(rpc::create_node(server));
    ttrpc_server.start().await.expect("start ttrpc");
    (address, ttrpc_server)
}

#[tokio::test]
async fn ttrpc_shim_client_calls_the_twig_service() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = Arc::new(Server::default());
    let (address, mut ttrpc_server) = serve(&dir, server.clone()).await;
    let shim = TtrpcShim {
        timeout: Duration::from_secs(10),
    };
    let sandbox = Sandbox {
        id: "sb-1".into(),
        address: address.clone(),
    };

    let first = shim
        .snapshot(&sandbox, "a", SnapshotMode::Full)
        .await
        .expect("snapshot");
    assert_eq!(
        first,
        SnapshotInfo {
            snapshot_id: "a".into(),
            parent_id: None,
            size_bytes: 1 << 27,
            written_bytes: 1 << 12,
            memory_bytes: 1 << 26,
            disk_bytes: 1 << 20,
            restore_bytes: (1 << 27) + (1 << 30),
        }
    );
    let second = shim
        .snapshot(&sandbox, "b", SnapshotMode::Incremental)
        .await
        .expect("snapshot");
    assert_eq!(second.parent_id.as_deref(), Some("a"));
    assert_eq!(
        *server.requests.lock().expect("lock"),
        ["snapshot sb-1 a full=true", "snapshot sb-1 b full=false"]
    );

    shim.rollback(&sandbox, "a", "op-1")
        .await
        .expect("rollback");
    let stats = shim.stats(&sandbox).await.expect("stats");
    assert_eq!(stats.last_rollback_operation_id.as_deref(), Some("op-1"));
    assert_eq!(
        stats
            .snapshots
            .iter()
            .map(|s| s.snapshot_id.as_str())
            .collect::<Vec<_>>(),
        ["a", "b"]
    );

    // Errors keep their meaning.
    let refused = shim
        .rollback(&sandbox, "zzz", "op-2")
        .await
        .expect_err("refused");
    assert!(
        matches!(&refused, ShimError::Refused(m) if m.contains("lineage")),
        "{refused:?}"
    );
    let other = Sandbox {
        id: "sb-2".into(),
        address: address.clone(),
    };
    let missing = shim
        .snapshot(&other, "c", SnapshotMode::Full)
        .await
        .expect_err("no sandbox");
    assert!(matches!(missing, ShimError::NotFound(_)), "{missing:?}");

    // The node service on the same kind of socket.
    let node = TtrpcNode {
        address,
        timeout: Duration::from_secs(10),
    };
    assert_eq!(
        node.get_snapshot("a").await.expect("get"),
        Some(first.clone()),
        "the node's answer carries the sizes"
    );
    assert_eq!(
        node.store_usage().await.expect("store usage"),
        StoreUsage {
            allocated_bytes: 5 << 20,
            capacity_bytes: 10 << 30,
            free_bytes: 7 << 30,
            snapshots: 2,
            templates: 1,
        }
    );
    node.delete_snapshot("a").await.expect("delete");
    assert_eq!(node.get_snapshot("a").await.expect("get"), None);
    assert_eq!(
        shim.stats(&sandbox).await.expect("stats").snapshots.len(),
        1
    );
    let spec = SandboxTemplateSpec {
        image: "python:3".into(),
        vcpus: 2,
        memory_mib: 512,
        command: Some(vec!["python3".into()]),
        warmup: None,
        egress_policy: None,
    };
    let state = node
        .ensure_template("default/py", &spec, BuildIn::NodePod, None)
        .await
        .expect("template");
    assert!(!state.ready);
    assert_eq!(state.message.as_deref(), Some("booting"));
    assert!(server
        .requests
        .lock()
        .expect("lock")
        .contains(&"template default/py python:3 2x512 [\"python3\"] policy=\"\"".to_string()));
    // Where the build runs travels with the request, and the node's answer
    // (a build Pod wanted, a build failed) comes back.
    let sent = || server.build_pod.lock().expect("lock").clone();
    assert_eq!(sent(), None, "a node-run build names no Pod");
    let state = node
        .ensure_template("default/py", &spec, BuildIn::BuildPod(None), None)
        .await
        .expect("template");
    assert_eq!(sent().as_deref(), Some(""));
    assert!(state.needs_build_pod && !state.failed, "{state:?}");
    let state = node
        .ensure_template("default/py", &spec, BuildIn::BuildPod(Some("spent")), None)
        .await
        .expect("template");
    assert_eq!(sent().as_deref(), Some("spent"));
    assert!(state.failed && !state.needs_build_pod, "{state:?}");
    // The template's policy travels as twig-net's JSON.
    let policy: EgressPolicy = serde_json::from_value(serde_json::json!({
        "defaultAction": "deny",
        "allow": [{"cidr": "10.96.0.10/32", "protocol": "udp", "ports": [{"port": 53}]}],
    }))
    .expect("policy");
    let with_policy = SandboxTemplateSpec {
        egress_policy: Some(policy.clone()),
        ..spec
    };
    node.ensure_template("default/py", &with_policy, BuildIn::NodePod, None)
        .await
        .expect("template");
    let sent = server
        .requests
        .lock()
        .expect("lock")
        .last()
        .cloned()
        .expect("request");
    let json = sent
        .split_once(" policy=")
        .map(|(_, p)| serde_json::from_str::<String>(p).expect("quoted"))
        .expect("policy field");
    assert_eq!(
        serde_json::from_str::<EgressPolicy>(&json).expect("the sent JSON is a policy"),
        policy
    );
    // SetEgressPolicy, and the policy in force and counters in Stats.
    shim.set_egress_policy(&sandbox, Some(&policy))
        .await
        .expect("set policy");
    let network = shim
        .stats(&sandbox)
        .await
        .expect("stats")
        .network
        .expect("network path");
    assert_eq!(network.egress_policy.as_ref(), Some(&policy));
    assert_eq!(
        network.counters,
        [NetworkCounter {
            reason: "deny_rule".into(),
            dropped: true,
            packets: 3,
            bytes: 180
        }]
    );
    shim.set_egress_policy(&sandbox, None)
        .await
        .expect("default policy");
    assert_eq!(
        shim.stats(&sandbox)
            .await
            .expect("stats")
            .network
            .and_then(|n| n.egress_policy),
        Some(EgressPolicy::default())
    );
    let refused = shim
        .set_egress_policy(&other, Some(&policy))
        .await
        .expect_err("no network path");
    assert!(
        matches!(&refused, ShimError::Refused(m) if m.contains("no network path")),
        "{refused:?}"
    );
    // A policy in force this controller cannot read is unknown, not an error.
    *server.egress_policy.lock().expect("lock") = "{\"defaultAction\": \"maybe\"}".into();
    let unreadable = shim.stats(&sandbox).await.expect("stats").network;
    assert_eq!(unreadable.map(|n| n.egress_policy), Some(None));
    assert!(server.requests.lock().expect("lock").contains(&format!(
        "policy sb-1 {:?}",
        serde_json::to_string(&policy).expect("json")
    )));
    assert!(server
        .requests
        .lock()
        .expect("lock")
        .contains(&"policy sb-1 \"\"".to_string()));

    // A method this server does not implement answers NOT_FOUND.
    let unimplemented = node
        .delete_template("default/py")
        .await
        .expect_err("not implemented");
    assert!(
        matches!(unimplemented, ShimError::NotFound(_)),
        "{unimplemented:?}"
    );

    ttrpc_server.shutdown().await.expect("shutdown");
    let gone = shim.stats(&sandbox).await.expect_err("server gone");
    assert!(matches!(gone, ShimError::Unavailable { .. }), "{gone:?}");
}

fn pod(uid: &str) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some("redis".into()),
            uid: Some(uid.into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

fn bundle(root: &std::path::Path, id: &str, annotations: serde_json::Value, address: &str) {
    let dir = root.join(id);
    std::fs::create_dir_all(&dir).expect("bundle dir");
    let spec = serde_json::json!({"ociVersion": "1.1.0", "annotations": annotations});
    std::fs::write(dir.join("config.json"), spec.to_string()).expect("config.json");
    std::fs::write(dir.join("address"), format!("{address}\n")).expect("address");
}

#[tokio::test]
async fn containerd_locator_finds_the_pods_sandbox_bundle() {
    let root = tempfile::tempdir().expect("tempdir");
    // The pod's app container shares the pod UID but is not the sandbox.
    bundle(
        root.path(),
        "c0ffee",
        serde_json::json!({"io.kubernetes.cri.container-type": "container", "io.kubernetes.cri.sandbox-uid": "uid-1"}),
        "unix:///run/containerd/s/app",
    );
    bundle(
        root.path(),
        "5a4db0c5",
        serde_json::json!({"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-uid": "uid-1"}),
        "unix:///run/containerd/s/abc",
    );
    bundle(
        root.path(),
        "0ther",
        serde_json::json!({"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-uid": "uid-2"}),
        "unix:///run/containerd/s/def",
    );
    std::fs::create_dir_all(root.path().join("half-written")).expect("dir");
    let locator = ContainerdLocator::new(root.path().to_path_buf());
    let sandbox = locator.locate(&pod("uid-1")).await.expect("found");
    assert_eq!(
        sandbox,
        Sandbox {
            id: "5a4db0c5".into(),
            address: "unix:///run/containerd/s/abc".into()
        }
    );
    let missing = locator.locate(&pod("uid-3")).await.expect_err("no sandbox");
    assert!(
        matches!(missing, LocateError::NotFound(ref u) if u == "uid-3"),
        "{missing:?}"
    );
    // A bundle whose config.json is not written yet is read again later,
    // and bundles that are gone are forgotten.
    std::fs::remove_dir_all(root.path().join("5a4db0c5")).expect("remove");
    assert!(matches!(
        locator.locate(&pod("uid-1")).await,
        Err(LocateError::NotFound(_))
    ));
    assert_eq!(locator.known_bundles(), 2, "c0ffee and 0ther only");
    bundle(
        root.path(),
        "half-written",
        serde_json::json!({"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-uid": "uid-1"}),
        "unix:///run/containerd/s/late",
    );
    let late = locator.locate(&pod("uid-1")).await.expect("found later");
    assert_eq!(late.address, "unix:///run/containerd/s/late");
    // A bundle made again under a gone one's name is read again.
    std::fs::remove_dir_all(root.path().join("0ther")).expect("remove");
    assert!(matches!(
        locator.locate(&pod("uid-2")).await,
        Err(LocateError::NotFound(_))
    ));
    bundle(
        root.path(),
        "0ther",
        serde_json::json!({"io.kubernetes.cri.container-type": "sandbox", "io.kubernetes.cri.sandbox-uid": "uid-4"}),
        "unix:///run/containerd/s/new",
    );
    let again = locator.locate(&pod("uid-4")).await.expect("the new bundle");
    assert_eq!(again.address, "unix:///run/containerd/s/new");
    let nowhere = ContainerdLocator::new(root.path().join("absent"));
    assert!(matches!(
        nowhere.locate(&pod("uid-1")).await,
        Err(LocateError::Io { .. })
    ));
}
