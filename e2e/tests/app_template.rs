//! App templates through the real node daemon, containerd's CRI and the
//! shim: the controller's own node client asks twig-node to
//! `EnsureTemplate` a counter image with a warm-up command; the daemon
//! builds it as a pod of the twig handler through CRI, runs the warm-up in
//! it, has its shim snapshot it into the node store and removes the pod.
//! Then the test plays kubelet: two pods annotated `twig.dev/template`
//! restore from it, their first container adopts the template's running
//! counter (the warm-up's file in guest memory is there; the container's
//! own command is not run), each with its own hostname and disk. The
//! template cannot be deleted while they run. Failures: a warm-up that
//! exits 3 and an image that does not exist are reported in the answer
//! and leave no pod and nothing in the store; a pod naming a template not
//! built fails RunPodSandbox clearly.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test app_template`).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use twig_controller::crd::SandboxTemplateSpec;
use twig_controller::shim::{BuildIn, NodeService, TemplateState, TtrpcNode};
use twig_cri::api::PodSandboxConfig;
use twig_cri::{container_config, logs};
use twig_e2e::cri::CriNode;
use twig_e2e::crilab::{runtime, CriLab, COUNTER, PROGRESS};
use twig_e2e::BASE_MEM_MIB;
use twig_e2e::IMAGE_REF;
use twig_store::NodeStore;

/// Deadline of one call to the node daemon or CRI.
const CALL: Duration = Duration::from_secs(300);
/// Deadline of a template build in the lab (a pod start, a warm-up and a
/// full snapshot of the lab's guest under TCG).
const BUILD: Duration = Duration::from_secs(600);
const POLL: Duration = Duration::from_millis(200);
const HANDLER: &str = "twig";
const ANNOTATION: &str = "twig.dev/template";
const NAMESPACE: &str = "default";

fn step(t0: Instant, what: &str) {
    eprintln!(
        "app-template: {:>7.2} s  {what}",
        t0.elapsed().as_secs_f64()
    );
}

/// A unique template name: the lab's nodes share one store.
fn unique(name: &str) -> String {
    format!("{name}-{}", std::process::id())
}

fn spec(command: &[&str], warmup: &[&str], image: &str) -> SandboxTemplateSpec {
    SandboxTemplateSpec {
        image: image.to_string(),
        vcpus: 1,
        memory_mib: u32::try_from(BASE_MEM_MIB).unwrap_or(u32::MAX),
        command: Some(command.iter().map(|s| s.to_string()).collect()),
        warmup: Some(warmup.iter().map(|s| s.to_string()).collect()),
        egress_policy: None,
    }
}

struct Harness {
    lab: CriLab,
    twig: TtrpcNode,
}

impl std::ops::Deref for Harness {
    type Target = CriLab;
    fn deref(&self) -> &CriLab {
        &self.lab
    }
}

impl Harness {
    async fn start() -> Harness {
        let lab = CriLab::start().await;
        let twig = TtrpcNode {
            address: format!("unix://{}", lab.dir().join("node.sock").display()),
            timeout: CALL,
        };
        Harness { lab, twig }
    }

    fn store(&self) -> NodeStore {
        let config = self.dir().join("node.json");
        let text = std::fs::read_to_string(&config)
            .unwrap_or_else(|e| panic!("reading {}: {e}", config.display()));
        let json: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{config:?}: {e}"));
        let root = PathBuf::from(json["store"].as_str().unwrap_or_default());
        NodeStore::open(&root, false).unwrap_or_else(|e| panic!("the node store: {e}"))
    }

    async fn ensure(&self, key: &str, spec: &SandboxTemplateSpec) -> TemplateState {
        self.twig
            .ensure_template(key, spec, BuildIn::NodePod, None)
            .await
            .unwrap_or_else(|e| panic!("EnsureTemplate {key}: {e}\n{}", self.logs()))
    }

    /// EnsureTemplate until `done` holds for the answer.
    async fn ensure_until(
        &self,
        key: &str,
        spec: &SandboxTemplateSpec,
        done: impl Fn(&TemplateState) -> bool,
    ) -> TemplateState {
        let deadline = Instant::now() + BUILD;
        loop {
            let state = self.ensure(key, spec).await;
            if done(&state) {
                return state;
            }
            assert!(
                Instant::now() < deadline,
                "template {key} did not get there within {BUILD:?}: {state:?}\n{}",
                self.logs()
            );
            tokio::time::sleep(POLL).await;
        }
    }

    /// The build pods CRI still knows of.
    async fn build_pods(&self) -> Vec<String> {
        self.cri
            .list_pod_sandboxes()
            .await
            .unwrap_or_else(|e| panic!("{}", self.node.cri_error("ListPodSandbox", e)))
            .into_iter()
            .filter_map(|p| p.metadata.map(|m| m.name))
            .filter(|n| n.starts_with("twig-template-"))
            .collect()
    }

    fn pod(&self, name: &str, template: &str) -> PodSandboxConfig {
        let mut pod = self.node.pod_config(name).unwrap_or_else(|e| panic!("{e}"));
        pod.annotations.insert(ANNOTATION.into(), template.into());
        pod
    }

    /// A pod of `template` with one container, `main`, whose own command
    /// would only sleep: it adopts the template's counter instead.
    async fn run(&self, pod: &PodSandboxConfig) -> (String, String) {
        let pod_id = self
            .cri
            .run_pod_sandbox(pod, HANDLER)
            .await
            .unwrap_or_else(|e| panic!("{}", self.node.cri_error("RunPodSandbox", e)));
        let config = container_config("main", IMAGE_REF, &["sleep", "7777"], "main.log");
        let id = self
            .cri
            .create_container(&pod_id, &config, pod)
            .await
            .unwrap_or_else(|e| panic!("{}", self.node.cri_error("CreateContainer", e)));
        self.cri
            .start_container(&id)
            .await
            .unwrap_or_else(|e| panic!("{}", self.node.cri_error("StartContainer", e)));
        (pod_id, id)
    }
}

#[test]
fn pods_restore_from_an_app_template_the_node_built_through_cri() {
    runtime().block_on(scenario());
}

async fn scenario() {
    let t0 = Instant::now();
    let h = Harness::start().await;
    step(t0, "node up");
    let name = unique("counter");
    let key = format!("{NAMESPACE}/{name}");
    let id = format!("template.{NAMESPACE}.{name}");
    let counter = spec(
        &["/bin/sh", "-c", COUNTER],
        &["/bin/sh", "-c", "echo warm > /dev/shm/warm"],
        IMAGE_REF,
    );

    // Not there yet: the first answer starts the build.
    let first = h.ensure(&key, &counter).await;
    assert!(!first.ready, "{first:?}");
    assert!(
        first
            .message
            .as_deref()
            .unwrap_or_default()
            .contains("building"),
        "{first:?}"
    );
    let ready = h
        .ensure_until(&key, &counter, |s| {
            assert!(
                !s.message.as_deref().unwrap_or_default().contains("failed"),
                "the build failed: {s:?}"
            );
            s.ready
        })
        .await;
    assert!(ready.ready);
    step(t0, "template built");
    // The build pod is gone; the template is in the store, with its inputs.
    assert_eq!(h.build_pods().await, Vec::<String>::new());
    let snap = h
        .store()
        .get(&id)
        .unwrap_or_else(|e| panic!("template {id} in the store: {e}"));
    assert_eq!(snap.labels.get("twig.dev/template"), Some(&key));
    assert!(
        snap.labels.contains_key("twig.dev/template-spec"),
        "{:?}",
        snap.labels
    );

    // Two pods of the template, as kubelet makes them.
    let pod_a = h.pod("from-template-a", &name);
    let (pod_a_id, a) = h.run(&pod_a).await;
    let pod_b = h.pod("from-template-b", &name);
    let (pod_b_id, b) = h.run(&pod_b).await;
    step(t0, "two pods of the template run");
    for (c, host) in [(&a, "from-template-a"), (&b, "from-template-b")] {
        // The warm-up's state is in guest memory, and the template's
        // counter runs on (the container's `sleep` was not started).
        assert_eq!(
            h.exec(c, &["cat", "/dev/shm/warm"]).await,
            (0, "warm".to_string())
        );
        let n = h.wait_count(c, "/dev/shm/count", |_| true).await;
        h.wait_count(c, "/dev/shm/count", |m| m > n + 5).await;
        let (_, sleeping) = h
            .exec(c, &["sh", "-c", "ps | grep -c '[s]leep 7777'"])
            .await;
        assert_eq!(sleeping, "0", "the container's own command runs in {host}");
        assert_eq!(h.exec(c, &["hostname"]).await, (0, host.to_string()));
    }
    // Their output goes to their own CRI logs.
    let log = CriNode::container_log(&pod_a, "main.log");
    let lines = logs::wait_for(&log, PROGRESS, |l| l.len() >= 3)
        .await
        .unwrap_or_else(|e| panic!("pod a's log: {e}\n{}", h.logs()));
    assert!(
        lines.iter().any(|l| l.text.starts_with("count ")),
        "{lines:?}"
    );
    // Each has its own copy of the template's disk.
    assert_eq!(
        h.exec(&a, &["sh", "-c", "echo a > /mark && sync"]).await.0,
        0
    );
    assert_ne!(
        h.exec(&b, &["test", "-e", "/mark"]).await.0,
        0,
        "a's file shows in b"
    );
    step(t0, "adopted, own identity, own disk");

    // The template stays while pods restored from it run.
    let e = h
        .twig
        .delete_template(&key)
        .await
        .expect_err("DeleteTemplate of a template in use");
    assert!(e.to_string().contains("in use"), "{e}");
    for pod in [&pod_a_id, &pod_b_id] {
        h.remove_pod(pod).await;
    }
    let deadline = Instant::now() + PROGRESS;
    loop {
        match h.twig.delete_template(&key).await {
            Ok(()) => break,
            Err(e) => assert!(
                Instant::now() < deadline && e.to_string().contains("in use"),
                "DeleteTemplate after the pods went: {e}\n{}",
                h.logs()
            ),
        }
        tokio::time::sleep(POLL).await;
    }
    assert!(
        h.store().get(&id).is_err(),
        "template {id} is still in the store"
    );
    step(t0, "deleted once unused");

    // A pod naming a template this node did not build.
    let missing = h.pod("no-template", &unique("never-built"));
    let err = h
        .cri
        .run_pod_sandbox(&missing, HANDLER)
        .await
        .expect_err("RunPodSandbox of a template not built");
    assert!(
        err.to_string().contains("is not built on this node"),
        "{err}"
    );

    // A warm-up that fails, and an image that does not exist: the answer
    // says why, and nothing is left.
    let failing = unique("failing");
    let state = h
        .ensure_until(
            &format!("{NAMESPACE}/{failing}"),
            &spec(
                &["sleep", "3600"],
                &["sh", "-c", "echo nope >&2; exit 3"],
                IMAGE_REF,
            ),
            |s| s.message.as_deref().unwrap_or_default().contains("failed"),
        )
        .await;
    let message = state.message.unwrap_or_default();
    assert!(!state.ready);
    assert!(
        message.contains("exited with 3") && message.contains("nope"),
        "{message}"
    );
    let absent = unique("absent");
    let image = "localhost:1/twig-e2e/absent:1";
    let state = h
        .ensure_until(
            &format!("{NAMESPACE}/{absent}"),
            &spec(&["sleep", "3600"], &[], image),
            |s| s.message.as_deref().unwrap_or_default().contains("failed"),
        )
        .await;
    let message = state.message.unwrap_or_default();
    assert!(message.contains(&format!("pulling {image}")), "{message}");
    assert_eq!(h.build_pods().await, Vec::<String>::new());
    for n in [&failing, &absent] {
        let id = format!("template.{NAMESPACE}.{n}");
        assert!(h.store().get(&id).is_err(), "{id} is in the store");
    }
    h.node
        .expect_nothing_left(&[], PROGRESS, "after the template pods and builds")
        .await;
    step(t0, "failures reported, nothing left");
}
