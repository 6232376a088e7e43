//! The code-interpreter workflow: a Python interpreter warmed once into an
//! app template, then pods restored from it answering without a cold
//! start. twig-node builds the template from the lab's Python image
//! (python3.11 and its standard library from Debian's packages) with a
//! server that imports a set of standard modules (json, decimal,
//! asyncio, email, http.client, xml, sqlite3, ssl, …) and then evaluates
//! expressions it reads from a FIFO; the warm-up waits for the imports.
//! Then, playing kubelet: a pod of the template answers from the
//! template's interpreter — started before the pod, its modules already
//! imported — and a plain pod of the same image (restored from the base
//! template) starts Python cold. Both answer correctly; each answer says
//! when its interpreter started, which also shows the plain pod's guest
//! clock is the host's. The times to the first answer are printed for the
//! record (BENCHMARKS.md of twig-cri), not asserted.
//! Built with `--features lab`, run in the nested lab
//! (`tests/lab/run.sh -p twig-e2e --features twig-e2e/lab --test python_template`).

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;
use twig_controller::crd::SandboxTemplateSpec;
use twig_controller::shim::{BuildIn, NodeService, TtrpcNode};
use twig_cri::api::PodSandboxConfig;
use twig_cri::container_config;
use twig_e2e::crilab::{runtime, CriLab};
use twig_e2e::BASE_MEM_MIB;

const PYTHON_REF: &str = "docker.io/library/twig-e2e-python:v1";
/// Deadline of one call to the node daemon.
const CALL: Duration = Duration::from_secs(300);
/// Deadline of the template's build (a pod start, the cold imports and a
/// full snapshot under TCG).
const BUILD: Duration = Duration::from_secs(900);
/// Deadline of one answer, a cold start included.
const ANSWER: Duration = Duration::from_secs(300);
const POLL: Duration = Duration::from_millis(200);
const NAMESPACE: &str = "default";

/// The interpreter: makes its request FIFO, imports, marks itself ready,
/// then answers each expression written to the FIFO with a JSON line in
/// `/tmp/ans` (written aside, then renamed).
const SERVER: &str = r#"
import os, sys, time
started = time.time()
if not os.path.exists('/tmp/req'):
    os.mkfifo('/tmp/req')
import json, decimal, fractions, statistics, asyncio, email.parser, http.client
import xml.etree.ElementTree, argparse, datetime, sqlite3, hashlib, ssl, zlib
imported = time.time() - started
open('/tmp/ready', 'w').close()
print(f'ready modules={len(sys.modules)} import_s={imported:.2f}', flush=True)
while True:
    with open('/tmp/req') as f:
        expr = f.read().strip()
    if not expr:
        continue
    t = time.time()
    value = eval(expr)
    answer = {'value': str(value), 'started': started, 'modules': len(sys.modules),
              'import_s': imported, 'eval_s': time.time() - t}
    with open('/tmp/ans.new', 'w') as f:
        json.dump(answer, f)
    os.rename('/tmp/ans.new', '/tmp/ans')
"#;

/// The expression every pod evaluates: needs `decimal`, imported.
const EXPR: &str = "str(decimal.Decimal(1) / decimal.Decimal(7))";
const VALUE: &str = "0.1428571428571428571428571429";

/// Asks the pod's interpreter through its FIFO (waiting for the FIFO to
/// exist: a cold pod's server makes it first thing).
const ASK: &str = "while [ ! -p /tmp/req ]; do sleep 0.05; done; rm -f /tmp/ans; \
     echo \"$1\" > /tmp/req; while [ ! -e /tmp/ans ]; do sleep 0.05; done; cat /tmp/ans";

fn step(t0: Instant, what: &str) {
    eprintln!("python: {:>7.2} s  {what}", t0.elapsed().as_secs_f64());
}

fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or_default()
}

/// Starts a pod of `pod` whose one container runs `command`; returns the
/// pod's and the container's ids.
async fn run(lab: &CriLab, pod: &PodSandboxConfig, command: &[&str]) -> (String, String) {
    let config = container_config("python", PYTHON_REF, command, "python.log");
    lab.run_pod(pod, "twig", &config).await
}

/// The interpreter's answer to [`EXPR`].
async fn ask(lab: &CriLab, id: &str) -> Value {
    let out = lab
        .cri
        .exec_sync(id, &["/bin/sh", "-c", ASK, "sh", EXPR], ANSWER)
        .await
        .unwrap_or_else(|e| lab.fail("ExecSync", e));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.exit_code, 0, "asking {id}: {text} {}", lab.logs());
    let answer: Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("the answer of {id} is not JSON ({e}): {text}"));
    assert_eq!(answer["value"], VALUE, "{answer}");
    answer
}

#[test]
fn a_warmed_python_template_answers_without_a_cold_start() {
    runtime().block_on(scenario());
}

async fn scenario() {
    let image = PathBuf::from(
        std::env::var_os("TWIG_E2E_PYTHON_IMAGE").unwrap_or_else(|| {
            panic!(
                "TWIG_E2E_PYTHON_IMAGE is not set: run this test through tests/lab/run.sh, which \
             builds the Python image"
            )
        }),
    );
    let t0 = Instant::now();
    let lab = CriLab::start().await;
    lab.node
        .import_image(&image)
        .unwrap_or_else(|e| panic!("importing {}: {e}", image.display()));
    let node = TtrpcNode {
        address: format!("unix://{}", lab.dir().join("node.sock").display()),
        timeout: CALL,
    };
    step(t0, "node up, Python image imported");

    let name = format!("python-{}", std::process::id());
    let key = format!("{NAMESPACE}/{name}");
    let command = ["/usr/bin/python3.11", "-c", SERVER];
    let spec = SandboxTemplateSpec {
        image: PYTHON_REF.to_string(),
        vcpus: 1,
        memory_mib: u32::try_from(BASE_MEM_MIB).unwrap_or(u32::MAX),
        command: Some(command.iter().map(|s| s.to_string()).collect()),
        warmup: Some(
            [
                "/bin/sh",
                "-c",
                "while [ ! -e /tmp/ready ]; do sleep 0.1; done",
            ]
            .iter()
            .map(|s| s.to_string())
            .collect(),
        ),
        egress_policy: None,
    };
    let deadline = Instant::now() + BUILD;
    loop {
        let state = node
            .ensure_template(&key, &spec, BuildIn::NodePod, None)
            .await
            .unwrap_or_else(|e| panic!("EnsureTemplate {key}: {e}\n{}", lab.logs()));
        let message = state.message.clone().unwrap_or_default();
        assert!(!message.contains("failed"), "the build failed: {state:?}");
        if state.ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "template {key} not built within {BUILD:?}: {state:?}\n{}",
            lab.logs()
        );
        tokio::time::sleep(POLL).await;
    }
    step(t0, "template built (the imports ran once, in its build)");

    // A pod of the template: its container adopts the template's running
    // interpreter (the container's own command only sleeps).
    let mut pod = lab
        .node
        .pod_config("py-warm")
        .unwrap_or_else(|e| panic!("{e}"));
    pod.annotations
        .insert("twig.dev/template".into(), name.clone());
    let asked = now_s();
    let started = Instant::now();
    let (warm_pod, warm) = run(&lab, &pod, &["sleep", "7777"]).await;
    let warm_answer = ask(&lab, &warm).await;
    let warm_s = started.elapsed().as_secs_f64();
    step(t0, &format!("template pod answered: {warm_answer}"));
    let began = warm_answer["started"].as_f64().unwrap_or_default();
    assert!(
        began < asked,
        "the template pod's interpreter started at {began}, after the pod was asked for at \
         {asked}: it was started cold"
    );
    assert!(
        warm_answer["modules"].as_u64().unwrap_or_default() > 100,
        "{warm_answer}"
    );

    // A plain pod of the same image starts Python cold.
    let cold_pod = lab
        .node
        .pod_config("py-cold")
        .unwrap_or_else(|e| panic!("{e}"));
    let asked = now_s();
    let started = Instant::now();
    let (cold_pod_id, cold) = run(&lab, &cold_pod, &command).await;
    let cold_answer = ask(&lab, &cold).await;
    let cold_s = started.elapsed().as_secs_f64();
    step(t0, &format!("plain pod answered: {cold_answer}"));
    let began = cold_answer["started"].as_f64().unwrap_or_default();
    // Its guest clock is the host's (the pod's VM was restored from the
    // base template, built minutes ago), give or take the lab's slowness.
    assert!(
        began > asked - 5.0 && began < now_s() + 5.0,
        "the plain pod's interpreter started at {began} by its clock, the host asked at \
         {asked}: the guest's clock is not the host's"
    );
    eprintln!(
        "python: first answer from pod start: template pod {warm_s:.2} s, plain pod \
         {cold_s:.2} s (its imports alone {:.2} s in the guest)",
        cold_answer["import_s"].as_f64().unwrap_or_default()
    );

    // Gone, the template with them.
    for pod in [&warm_pod, &cold_pod_id] {
        lab.remove_pod(pod).await;
    }
    let deadline = Instant::now() + ANSWER;
    loop {
        match node.delete_template(&key).await {
            Ok(()) => break,
            Err(e) => assert!(
                Instant::now() < deadline && e.to_string().contains("in use"),
                "DeleteTemplate after the pods went: {e}\n{}",
                lab.logs()
            ),
        }
        tokio::time::sleep(POLL).await;
    }
    step(t0, "done");
}
