//! The pod network reconciler against the test API server and the fake
//! node: each running Twig pod of the node gets its effective egress policy
//! (its SandboxTemplate's, else the built-in default, narrowed — never
//! widened — by its annotation) set on its shim only when the policy in
//! force differs; malformed policies, widened annotations, gone templates
//! and failing shims are warned about; the path's counters are on
//! `/metrics` under the pod's namespace and name until it is deleted.

use twig_controller_testkit as support;

use std::sync::Arc;

use k8s_openapi::api::core::v1::Pod;
use kube::api::{DeleteParams, Patch, PatchParams};
use kube::{Api, Client, ResourceExt};
use serde_json::json;
use twig_controller::crd::{
    SandboxTemplate, SandboxTemplateSpec, EGRESS_POLICY_ANNOTATION, TEMPLATE_ANNOTATION,
};
use twig_controller::reconcile::network::{CLIPPED, FAILED, INVALID, TEMPLATE_NOT_FOUND, UPDATED};
use twig_controller::shim::NetworkCounter;
use twig_net::EgressPolicy;

use support::fake::{Call, FakeNode};
use support::{api_server, events_about, eventually, running_pod_with, start_controller, NS};

fn policy(value: serde_json::Value) -> EgressPolicy {
    serde_json::from_value(value).expect("policy")
}

fn deny_all() -> EgressPolicy {
    policy(
        json!({"defaultAction": "deny", "allow": [{"cidr": "203.0.113.0/24", "protocol": "tcp", "ports": [{"port": 443}]}]}),
    )
}

/// Only a public resolver (a private one is the template's to open).
fn only_dns() -> EgressPolicy {
    policy(
        json!({"defaultAction": "deny", "allow": [{"cidr": "192.0.2.53/32", "protocol": "udp", "ports": [{"port": 53}]}]}),
    )
}

fn text(p: &EgressPolicy) -> String {
    serde_json::to_string(p).expect("json")
}

async fn annotate(client: &Client, pod: &str, value: Option<String>) {
    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.patch(
        pod,
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"annotations": {EGRESS_POLICY_ANNOTATION: value}}})),
    )
    .await
    .expect("annotate pod");
}

async fn template(client: &Client, name: &str, policy: Option<EgressPolicy>) {
    let t = SandboxTemplate::new(
        name,
        SandboxTemplateSpec {
            image: "python:3.12".into(),
            vcpus: 1,
            memory_mib: 64,
            command: None,
            warmup: None,
            egress_policy: policy,
        },
    );
    support::create(client, &t).await;
}

fn uid(pod: &Pod) -> String {
    pod.uid().expect("uid")
}

fn stats_calls(fake: &FakeNode, pod: &Pod) -> usize {
    let id = format!("sb-{}", uid(pod));
    fake.calls()
        .iter()
        .filter(|c| **c == Call::Stats(id.clone()))
        .count()
}

/// Waits until the controller has read the pod's network path `n` more times.
async fn looked_again(fake: &FakeNode, pod: &Pod, n: usize) {
    let start = stats_calls(fake, pod);
    eventually("the controller to look at the pod again", || async {
        (stats_calls(fake, pod) >= start + n).then_some(())
    })
    .await;
}

/// Events about `name` with this reason: (type, note), one per occurrence.
/// kube's recorder publishes a repeated Event (same type, reason and
/// action) as a series of the first: its count grows, its note stays the
/// first one's.
async fn events(client: &Client, name: &str, reason: &str) -> Vec<(String, String)> {
    events_about(client, name)
        .await
        .into_iter()
        .filter(|e| e.reason.as_deref() == Some(reason))
        .flat_map(|e| {
            let count = e.series.as_ref().map_or(1, |s| s.count);
            let seen = (e.type_.unwrap_or_default(), e.note.unwrap_or_default());
            std::iter::repeat_n(seen, usize::try_from(count).unwrap_or(1))
        })
        .collect()
}

async fn wait_events(client: &Client, name: &str, reason: &str, n: usize) -> Vec<(String, String)> {
    eventually(&format!("{n} {reason} events about {name}"), || async {
        let seen = events(client, name, reason).await;
        (seen.len() >= n).then_some(seen)
    })
    .await
}

async fn wait_in_force(fake: &FakeNode, pod: &Pod, expected: &EgressPolicy) {
    eventually("the policy in force", || async {
        (fake.policy_in_force(&uid(pod)).as_ref() == Some(expected)).then_some(())
    })
    .await;
}

#[tokio::test]
async fn an_annotation_added_or_changed_is_set_once_with_an_event() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default().with_network_paths());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let pod = running_pod_with(&client, "agent", "node-a", true, &[]).await;

    // The built-in default is in force already: nothing to send.
    looked_again(&fake, &pod, 3).await;
    assert!(fake.set_policy_calls(&uid(&pod)).is_empty());
    assert!(events(&client, "agent", UPDATED).await.is_empty());

    annotate(&client, "agent", Some(text(&deny_all()))).await;
    wait_in_force(&fake, &pod, &deny_all()).await;
    let updated = wait_events(&client, "agent", UPDATED, 1).await;
    assert_eq!(updated[0].0, "Normal");
    assert!(
        updated[0].1.contains(EGRESS_POLICY_ANNOTATION),
        "{updated:?}"
    );

    annotate(&client, "agent", Some(text(&only_dns()))).await;
    wait_in_force(&fake, &pod, &only_dns()).await;
    wait_events(&client, "agent", UPDATED, 2).await;

    // The same policy again (and every periodic look): no call.
    annotate(&client, "agent", Some(text(&only_dns()))).await;
    looked_again(&fake, &pod, 3).await;
    assert_eq!(
        fake.set_policy_calls(&uid(&pod)),
        [Some(deny_all()), Some(only_dns())]
    );

    // Without the annotation (and no template) the built-in default returns.
    annotate(&client, "agent", None).await;
    wait_in_force(&fake, &pod, &EgressPolicy::default()).await;
    assert_eq!(
        fake.set_policy_calls(&uid(&pod)),
        [Some(deny_all()), Some(only_dns()), None]
    );
    assert_eq!(events(&client, "agent", UPDATED).await.len(), 3);
}

#[tokio::test]
async fn a_template_change_reaches_its_pods_and_bounds_those_with_their_own_policy() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default().with_network_paths());
    let _ctrl = start_controller(&server, "node-a", &fake);
    template(&client, "py", Some(deny_all())).await;
    let plain = running_pod_with(
        &client,
        "plain",
        "node-a",
        true,
        &[(TEMPLATE_ANNOTATION, "py".into())],
    )
    .await;
    let own = running_pod_with(
        &client,
        "own",
        "node-a",
        true,
        &[
            (TEMPLATE_ANNOTATION, "py".into()),
            (EGRESS_POLICY_ANNOTATION, text(&EgressPolicy::default())),
        ],
    )
    .await;
    wait_in_force(&fake, &plain, &deny_all()).await;
    // The pod's own policy (the default: public destinations by default)
    // is bounded by the template's: what both allow is the template's.
    wait_in_force(&fake, &own, &deny_all()).await;
    let clipped = wait_events(&client, "own", CLIPPED, 1).await;
    assert!(
        clipped[0]
            .1
            .contains("defaultAction: allow reaches past SandboxTemplate py"),
        "{clipped:?}"
    );

    let templates: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    templates
        .patch(
            "py",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"egressPolicy": only_dns()}})),
        )
        .await
        .expect("change the template's policy");
    wait_in_force(&fake, &plain, &only_dns()).await;
    let updated = wait_events(&client, "plain", UPDATED, 2).await;
    assert!(updated[0].1.contains("SandboxTemplate py"), "{updated:?}");
    assert_eq!(
        fake.set_policy_calls(&uid(&plain)),
        [Some(deny_all()), Some(only_dns())]
    );
    wait_in_force(&fake, &own, &only_dns()).await;
    assert_eq!(
        fake.set_policy_calls(&uid(&own)),
        [Some(deny_all()), Some(only_dns())]
    );
}

#[tokio::test]
async fn a_widened_annotation_never_reaches_the_shim_wider_than_its_bound() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default().with_network_paths());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let cluster = policy(
        json!({"defaultAction": "deny", "allow": [{"cidr": "10.88.0.0/16"}, {"cidr": "203.0.113.0/24", "protocol": "tcp", "ports": [{"port": 443}]}]}),
    );
    template(&client, "py", Some(cluster.clone())).await;
    // It reopens all of 10/8 and every public destination.
    let widened = policy(json!({"allow": [{"cidr": "10.0.0.0/8"}]}));
    let pod = running_pod_with(
        &client,
        "agent",
        "node-a",
        true,
        &[
            (TEMPLATE_ANNOTATION, "py".into()),
            (EGRESS_POLICY_ANNOTATION, text(&widened)),
        ],
    )
    .await;
    wait_in_force(&fake, &pod, &cluster).await;
    let clipped = wait_events(&client, "agent", CLIPPED, 1).await;
    assert_eq!(clipped[0].0, "Warning");
    for field in ["defaultAction", "allow[0]: 10.0.0.0/8 reaches past"] {
        assert!(clipped[0].1.contains(field), "{field}: {clipped:?}");
    }

    // Without a template the cluster's default bounds it: 10/8 stays closed.
    let bare = running_pod_with(
        &client,
        "bare",
        "node-a",
        true,
        &[(EGRESS_POLICY_ANNOTATION, text(&widened))],
    )
    .await;
    looked_again(&fake, &bare, 3).await;
    wait_events(&client, "bare", CLIPPED, 1).await;

    // Nothing wider than its bound ever reached either shim.
    let within = |p: &Option<EgressPolicy>, bound: &EgressPolicy| {
        let p = p.clone().unwrap_or_default();
        twig_net::bounded_policy(&p, bound, "bound").is_ok_and(|b| b.policy == p)
    };
    for sent in fake.set_policy_calls(&uid(&pod)) {
        assert!(within(&sent, &cluster), "{sent:?}");
    }
    for sent in fake.set_policy_calls(&uid(&bare)) {
        assert!(within(&sent, &EgressPolicy::default()), "{sent:?}");
    }
    assert_eq!(
        fake.policy_in_force(&uid(&bare)),
        Some(EgressPolicy::default())
    );
}

#[tokio::test]
async fn a_malformed_annotation_is_warned_about_once_and_nothing_is_sent() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let _ctrl = start_controller(&server, "node-a", &fake);
    let pod = running_pod_with(
        &client,
        "agent",
        "node-a",
        true,
        &[(
            EGRESS_POLICY_ANNOTATION,
            r#"{"defaultAction": "deny", "allow": [{"cidr": "10.0.0.1/8"}]}"#.into(),
        )],
    )
    .await;
    fake.set_policy_in_force(&uid(&pod), deny_all());

    let warnings = wait_events(&client, "agent", INVALID, 1).await;
    assert_eq!(warnings[0].0, "Warning");
    assert!(
        warnings[0].1.contains(&format!(
            "metadata.annotations[{EGRESS_POLICY_ANNOTATION}].allow[0].cidr"
        )),
        "{warnings:?}"
    );
    looked_again(&fake, &pod, 3).await;
    assert!(fake.set_policy_calls(&uid(&pod)).is_empty());
    assert_eq!(fake.policy_in_force(&uid(&pod)), Some(deny_all()));
    assert_eq!(events(&client, "agent", INVALID).await.len(), 1);

    annotate(&client, "agent", Some("not json".into())).await;
    wait_events(&client, "agent", INVALID, 2).await;
    assert!(fake.set_policy_calls(&uid(&pod)).is_empty());

    annotate(&client, "agent", Some(text(&only_dns()))).await;
    wait_in_force(&fake, &pod, &only_dns()).await;
    wait_events(&client, "agent", UPDATED, 1).await;
}

#[tokio::test]
async fn a_failing_shim_is_warned_about_and_retried() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default().with_network_paths());
    fake.fail_set_policy(2);
    let _ctrl = start_controller(&server, "node-a", &fake);
    let pod = running_pod_with(
        &client,
        "agent",
        "node-a",
        true,
        &[(EGRESS_POLICY_ANNOTATION, text(&deny_all()))],
    )
    .await;

    let warnings = wait_events(&client, "agent", FAILED, 1).await;
    assert_eq!(warnings[0].0, "Warning");
    assert!(
        warnings[0]
            .1
            .contains("the policy maps could not be written"),
        "{warnings:?}"
    );
    wait_in_force(&fake, &pod, &deny_all()).await;
    assert_eq!(
        fake.set_policy_calls(&uid(&pod)),
        [Some(deny_all()), Some(deny_all()), Some(deny_all())]
    );
    wait_events(&client, "agent", UPDATED, 1).await;
    // The same failure twice is one Warning.
    assert_eq!(events(&client, "agent", FAILED).await.len(), 1);
}

#[tokio::test]
async fn a_pod_whose_template_is_gone_keeps_its_policy() {
    let server = api_server().await;
    let client = server.client();
    support::register_node(&client, "node-a").await;
    let fake = Arc::new(FakeNode::default().with_network_paths());
    let _ctrl = start_controller(&server, "node-a", &fake);
    template(&client, "py", Some(deny_all())).await;
    let pod = running_pod_with(
        &client,
        "agent",
        "node-a",
        true,
        &[(TEMPLATE_ANNOTATION, "py".into())],
    )
    .await;
    wait_in_force(&fake, &pod, &deny_all()).await;

    let templates: Api<SandboxTemplate> = Api::namespaced(client.clone(), NS);
    templates
        .delete("py", &DeleteParams::default())
        .await
        .expect("delete template");
    support::wait_gone::<SandboxTemplate>(&client, "py").await;
    let warnings = wait_events(&client, "agent", TEMPLATE_NOT_FOUND, 1).await;
    assert_eq!(warnings[0].0, "Warning");
    assert!(
        warnings[0].1.contains("SandboxTemplate py is gone"),
        "{warnings:?}"
    );
    looked_again(&fake, &pod, 3).await;
    assert_eq!(fake.set_policy_calls(&uid(&pod)), [Some(deny_all())]);
    assert_eq!(fake.policy_in_force(&uid(&pod)), Some(deny_all()));

    // A pod naming a template that never existed is not loosened either.
    let never = running_pod_with(
        &client,
        "never",
        "node-a",
        true,
        &[(TEMPLATE_ANNOTATION, "nope".into())],
    )
    .await;
    fake.set_policy_in_force(&uid(&never), only_dns());
    wait_events(&client, "never", TEMPLATE_NOT_FOUND, 1).await;
    looked_again(&fake, &never, 2).await;
    assert!(fake.set_policy_calls(&uid(&never)).is_empty());
}

fn counter(reason: &str, dropped: bool, packets: u64, bytes: u64) -> NetworkCounter {
    NetworkCounter {
        reason: reason.into(),
        dropped,
        packets,
        bytes,
    }
}

#[tokio::test]
async fn metrics_carry_each_pods_counters_until_it_is_deleted() {
    let server = api_server().await;
    let client = server.client();
    let fake = Arc::new(FakeNode::default());
    let fake_b = Arc::new(FakeNode::default().with_network_paths());
    let ctrl = start_controller(&server, "node-a", &fake);
    let _b = start_controller(&server, "node-b", &fake_b);
    let agent = running_pod_with(&client, "agent", "node-a", true, &[]).await;
    let other = running_pod_with(&client, "other", "node-a", true, &[]).await;
    let runc = running_pod_with(&client, "runc", "node-a", false, &[]).await;
    let elsewhere = running_pod_with(&client, "elsewhere", "node-b", true, &[]).await;
    fake.set_counters(
        &uid(&agent),
        vec![
            counter("egress", false, 10, 1500),
            counter("deny_rule", true, 3, 180),
        ],
    );
    fake.set_counters(&uid(&other), vec![counter("egress", false, 1, 60)]);

    let line = |family: &str, pod: &str, verdict: &str, reason: &str, value: u64| {
        format!("twig_pod_network_{family}_total{{namespace=\"{NS}\",pod=\"{pod}\",verdict=\"{verdict}\",reason=\"{reason}\"}} {value}\n")
    };
    let expected = [
        line("packets", "agent", "pass", "egress", 10),
        line("packets", "agent", "drop", "deny_rule", 3),
        line("bytes", "agent", "pass", "egress", 1500),
        line("bytes", "agent", "drop", "deny_rule", 180),
        line("packets", "other", "pass", "egress", 1),
    ];
    let text = eventually("the pods' counters on /metrics", || async {
        let text = ctrl.metrics.encode().ok()?;
        expected
            .iter()
            .all(|l| text.contains(l.as_str()))
            .then_some(text)
    })
    .await;
    assert!(
        text.contains("# TYPE twig_pod_network_packets counter"),
        "{text}"
    );
    assert!(
        text.contains("# TYPE twig_pod_network_bytes counter"),
        "{text}"
    );

    // Counters move: the next read shows the new totals.
    fake.set_counters(&uid(&agent), vec![counter("deny_rule", true, 7, 420)]);
    eventually("the new totals", || async {
        let text = ctrl.metrics.encode().ok()?;
        (text.contains(&line("packets", "agent", "drop", "deny_rule", 7))
            && !text.contains(&line("packets", "agent", "pass", "egress", 10)))
        .then_some(())
    })
    .await;

    // Only this node's Twig pods are read and reported.
    let text = ctrl.metrics.encode().expect("encode");
    for pod in ["runc", "elsewhere"] {
        assert!(!text.contains(&format!("pod=\"{pod}\"")), "{text}");
    }
    for not_ours in [&runc, &elsewhere] {
        assert_eq!(stats_calls(&fake, not_ours), 0, "{:?}", fake.calls());
    }
    assert!(stats_calls(&fake_b, &elsewhere) > 0);

    let pods: Api<Pod> = Api::namespaced(client.clone(), NS);
    pods.delete("agent", &DeleteParams::default())
        .await
        .expect("delete pod");
    eventually("the deleted pod's series to go", || async {
        let text = ctrl.metrics.encode().ok()?;
        (!text.contains("pod=\"agent\"")).then_some(text)
    })
    .await;
    let text = ctrl.metrics.encode().expect("encode");
    assert!(
        text.contains(&line("packets", "other", "pass", "egress", 1)),
        "{text}"
    );
}
