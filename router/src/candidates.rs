//! Which of a service's ready replicas a request may go to on this attempt: a pure filter,
//! so the rule is tested apart from sockets and clocks. A replica already tried for this
//! request is out; so is one that just refused a connection (it may be gone while its pod is
//! still listed Ready), unless that would leave none.

use crate::members::Endpoint;

/// The replicas to choose from, in the service's order.
pub fn candidates<'a>(
    endpoints: &'a [Endpoint],
    tried: Option<&str>,
    set_aside: impl Fn(&Endpoint) -> bool,
) -> Vec<&'a Endpoint> {
    let untried: Vec<&Endpoint> = endpoints
        .iter()
        .filter(|e| tried != Some(e.name.as_str()))
        .collect();
    let reachable: Vec<&Endpoint> = untried.iter().copied().filter(|e| !set_aside(e)).collect();
    if reachable.is_empty() {
        untried
    } else {
        reachable
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn eps(names: &[&str]) -> Vec<Endpoint> {
        names
            .iter()
            .map(|n| Endpoint {
                name: n.to_string(),
                base_url: format!("http://{n}:8000"),
            })
            .collect()
    }

    fn names(v: Vec<&Endpoint>) -> Vec<&str> {
        v.into_iter().map(|e| e.name.as_str()).collect()
    }

    #[test]
    fn the_replica_tried_is_left_out() {
        let e = eps(&["a", "b", "c"]);
        assert_eq!(names(candidates(&e, Some("b"), |_| false)), ["a", "c"]);
        assert_eq!(names(candidates(&e, None, |_| false)), ["a", "b", "c"]);
        assert!(candidates(&eps(&["a"]), Some("a"), |_| false).is_empty());
    }

    #[test]
    fn set_aside_replicas_sit_out_unless_none_would_be_left() {
        let e = eps(&["a", "b", "c"]);
        assert_eq!(names(candidates(&e, None, |e| e.name != "c")), ["c"]);
        assert_eq!(
            names(candidates(&e, Some("c"), |e| e.name != "c")),
            ["a", "b"]
        );
        assert_eq!(names(candidates(&e, None, |_| true)), ["a", "b", "c"]);
    }
}
