//! The test kubelet (`twig_e2e::kubelet`) on the host, with runc: pods
//! written to the controller testkit's API server are run through the real
//! containerd CRI plugin of twig-cri's harness (a local registry, a CNI
//! bridge), their status is written back as the controller reads it, a pod
//! it cannot run fails with a clear message and leaves no sandbox, and a
//! deleted pod's sandbox is removed. Then what kubelet does for every pod
//! (the `kubelet_does` scenario of `scenario.rs`): volumes, the token,
//! DNS, /etc/hosts, init containers, probes, restarts, termination
//! messages. Needs root and the packages of `scripts/install-deps.sh`; no
//! Linux guest. The host tests run on the host only (the lab has no
//! registry, umoci or skopeo for the harness); in the lab the scenario
//! runs under runc and twig on the lab's node (`--features lab`).

#[path = "kubelet/scenario.rs"]
mod scenario;

#[cfg(feature = "lab")]
mod lab {
    use std::panic::AssertUnwindSafe;

    use futures::FutureExt;
    use twig_controller_testkit as testkit;
    use twig_e2e::cri::CriNode;
    use twig_e2e::kubelet::Kubelet;

    use super::scenario;

    /// The same pods under runc (the reference), then twig, on the lab's
    /// node; a failed half prints the node's logs (containerd's holds the
    /// shim's).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_test_kubelet_does_what_kubelet_does_under_runc_and_twig() {
        let node = CriNode::start().unwrap_or_else(|e| panic!("CRI node: {e}"));
        let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
        let server = testkit::api_server_with(testkit::schema::generated()).await;
        let dir = node
            .node()
            .dir()
            .unwrap_or_else(|e| panic!("{e}"))
            .to_path_buf();
        let config = scenario::config(&[twig_e2e::IMAGE_REF], &dir.join("kubelet-pods"));
        let root = config.root.clone();
        let _kubelet = Kubelet::start_with(
            server.client_as("kubelet"),
            scenario::NODE,
            cri.clone(),
            config,
        );
        let client = server.client();
        for handler in ["runc", "twig"] {
            let started = std::time::Instant::now();
            let run = scenario::kubelet_does(&cri, &client, &root, handler, twig_e2e::IMAGE_REF);
            if let Err(panic) = AssertUnwindSafe(run).catch_unwind().await {
                // containerd's log holds every shim's.
                eprintln!(
                    "kubelet scenario under {handler} failed after {:?}; the node's logs:\n{}",
                    started.elapsed(),
                    node.node().logs_of(300, 60)
                );
                std::panic::resume_unwind(panic);
            }
            eprintln!(
                "kubelet scenario under {handler}: passed in {:?}",
                started.elapsed()
            );
        }
    }
}

#[cfg(not(feature = "lab"))]
mod host {
    use std::future::Future;
    use std::time::{Duration, Instant};

    use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};
    use kube::api::{DeleteParams, ObjectMeta};
    use kube::{Api, ResourceExt};
    use twig_controller_testkit::{self as testkit, NS};
    use twig_cri::{Node, NodeOptions};
    use twig_e2e::kubelet::{container_id, sandbox_of, Kubelet};

    use super::scenario;

    use scenario::NODE;
    const WITHIN: Duration = Duration::from_secs(60);

    async fn until<T, F, Fut>(what: &str, mut check: F) -> T
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Option<T>>,
    {
        let deadline = Instant::now() + WITHIN;
        loop {
            if let Some(v) = check().await {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn pod(name: &str, image: &str) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(NS.into()),
                annotations: Some([("twig.dev/note".to_string(), "passed on".to_string())].into()),
                ..Default::default()
            },
            spec: Some(PodSpec {
                node_name: Some(NODE.into()),
                runtime_class_name: Some("runc".into()),
                containers: vec![Container {
                    name: "app".into(),
                    image: Some(image.into()),
                    command: Some(vec!["/bin/sh".into(), "-c".into()]),
                    args: Some(vec!["echo started > /tmp/started; exec sleep 3600".into()]),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_test_kubelet_runs_reports_and_removes_pods_through_cri() {
        let node =
            Node::start(&NodeOptions::default()).unwrap_or_else(|e| panic!("CRI harness: {e}"));
        let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
        let image = node.busybox_image().to_string();
        cri.pull_image(&image)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let server = testkit::api_server_with(testkit::schema::generated()).await;
        let client = server.client();
        let _kubelet = Kubelet::start(
            server.client_as("kubelet"),
            NODE,
            cri.clone(),
            &[&image],
            &node.dir().join("kubelet-pods"),
        );
        let pods: Api<Pod> = Api::namespaced(client.clone(), NS);

        // A pod bound to another node is not this kubelet's.
        let mut elsewhere = pod("elsewhere", &image);
        if let Some(spec) = elsewhere.spec.as_mut() {
            spec.node_name = Some("other-node".into());
        }
        testkit::create(&client, &elsewhere).await;

        // A pod it can run.
        let web = testkit::create(&client, &pod("web", &image)).await;
        let uid = web.uid().unwrap_or_default();
        let web = until("web to be reported", || async {
            let p = pods.get("web").await.ok()?;
            p.status.as_ref()?.phase.as_ref()?;
            Some(p)
        })
        .await;
        let status = web.status.clone().unwrap_or_default();
        assert_eq!(status.phase.as_deref(), Some("Running"), "{status:#?}");
        let ready = |type_: &str| {
            status
                .conditions
                .iter()
                .flatten()
                .any(|c| c.type_ == type_ && c.status == "True")
        };
        assert!(ready("Ready") && ready("ContainersReady"), "{status:#?}");
        let ip: std::net::IpAddr = status
            .pod_ip
            .as_deref()
            .unwrap_or_default()
            .parse()
            .unwrap_or_else(|e| panic!("podIP: {e}: {status:#?}"));
        let cs = &status.container_statuses.clone().unwrap_or_default()[0];
        assert!(cs.ready && cs.name == "app", "{cs:#?}");
        let id = container_id(&web, "app").unwrap_or_else(|| panic!("no container id: {cs:#?}"));
        // The container runs the pod's command and args, under the pod's name.
        let out = until("the container's command to run", || async {
            let out = cri
                .exec_sync(&id, &["sh", "-c", "cat /tmp/started; hostname"], WITHIN)
                .await
                .ok()?;
            (out.exit_code == 0).then(|| String::from_utf8_lossy(&out.stdout).into_owned())
        })
        .await;
        assert_eq!(out, "started\nweb\n");
        // The sandbox carries the pod's UID, namespace and annotations.
        let sandboxes = cri
            .list_pod_sandboxes()
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(sandboxes.len(), 1, "only this node's pod: {sandboxes:#?}");
        let sandbox = sandbox_of(&sandboxes, &uid).unwrap_or_else(|| panic!("{sandboxes:#?}"));
        assert_eq!(
            cri.pod_ip(&sandbox).await.ok(),
            Some(ip),
            "podIP is the sandbox's"
        );
        let sandbox_status = cri
            .pod_sandbox_status(&sandbox)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            sandbox_status
                .annotations
                .get("twig.dev/note")
                .map(String::as_str),
            Some("passed on")
        );
        assert_eq!(
            sandbox_status.metadata.map(|m| (m.name, m.namespace)),
            Some(("web".to_string(), NS.to_string()))
        );

        // A pod naming an image the node does not have fails, naming it, and
        // leaves no sandbox.
        testkit::create(&client, &pod("bad", "registry.invalid/nothing:1")).await;
        let bad = until("bad to be reported", || async {
            let p = pods.get("bad").await.ok()?;
            p.status.as_ref()?.phase.as_ref()?;
            Some(p)
        })
        .await;
        let status = bad.status.unwrap_or_default();
        assert_eq!(status.phase.as_deref(), Some("Failed"), "{status:#?}");
        let message = status.message.unwrap_or_default();
        assert!(
            message.contains("registry.invalid/nothing:1") && message.contains("container app"),
            "{message}"
        );
        assert_eq!(
            cri.list_pod_sandboxes().await.map(|s| s.len()).ok(),
            Some(1)
        );

        // Deleting the pod removes its sandbox.
        pods.delete("web", &DeleteParams::default())
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        until("web's sandbox to go", || async {
            cri.list_pod_sandboxes()
                .await
                .ok()?
                .is_empty()
                .then_some(())
        })
        .await;
    }

    /// What kubelet does for every pod, under runc (the reference).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_test_kubelet_does_what_kubelet_does_under_runc() {
        let node =
            Node::start(&NodeOptions::default()).unwrap_or_else(|e| panic!("CRI harness: {e}"));
        let cri = node.client().await.unwrap_or_else(|e| panic!("{e}"));
        let image = node.busybox_image().to_string();
        // CRI may still be initializing when another test's containerd
        // starts beside this one.
        until("the image to be pulled", || async {
            cri.pull_image(&image).await.ok()
        })
        .await;
        let server = testkit::api_server_with(testkit::schema::generated()).await;
        let config = scenario::config(&[&image], &node.dir().join("kubelet-pods"));
        let root = config.root.clone();
        let _kubelet = twig_e2e::kubelet::Kubelet::start_with(
            server.client_as("kubelet"),
            scenario::NODE,
            cri.clone(),
            config,
        );
        scenario::kubelet_does(&cri, &server.client(), &root, "runc", &image).await;
    }
}
