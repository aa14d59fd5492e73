//! Test ports come from below the ephemeral range, where no outgoing connection lands.

use std::collections::HashSet;
use std::net::TcpListener;

use ferrite_testkit::process::free_port;

#[test]
fn free_ports_are_bindable_distinct_and_below_the_ephemeral_range() {
    let first_ephemeral: u16 = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(32_768);
    let mut seen = HashSet::new();
    let mut held = Vec::new();
    for _ in 0..200 {
        let port = free_port();
        assert!(port < first_ephemeral, "{port} is in the ephemeral range");
        assert!(seen.insert(port), "{port} handed out twice");
        held.push(TcpListener::bind(("127.0.0.1", port)).expect("the port binds"));
    }
}
