//! One instance's LRU order over block keys: an intrusive doubly linked list in a slab.
//!
//! Slots are stable while a key is resident, so the cluster index can point at them.
//! Every operation is O(1). Not synchronised: owned by [`crate::cache::ClusterCache`].

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone)]
struct Node {
    key: u64,
    prev: u32,
    next: u32,
}

/// LRU list of keys; the head is the most recently touched.
#[derive(Debug, Clone)]
pub struct Lru {
    nodes: Vec<Node>,
    free: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl Default for Lru {
    fn default() -> Self {
        Self { nodes: Vec::new(), free: Vec::new(), head: NIL, tail: NIL, len: 0 }
    }
}

impl Lru {
    /// Number of resident keys.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no key is resident.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Insert `key` at the head; returns its slot.
    pub fn push_front(&mut self, key: u64) -> u32 {
        let node = Node { key, prev: NIL, next: self.head };
        let slot = match self.free.pop() {
            Some(s) => {
                self.nodes[s as usize] = node;
                s
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("more than 2^32 resident keys")
            }
        };
        self.link_head(slot);
        self.len += 1;
        slot
    }

    /// Move the key at `slot` to the head.
    pub fn move_to_front(&mut self, slot: u32) {
        if self.head == slot {
            return;
        }
        self.unlink(slot);
        self.nodes[slot as usize].prev = NIL;
        self.nodes[slot as usize].next = self.head;
        self.link_head(slot);
    }

    /// Remove and return the least recently touched key.
    pub fn pop_back(&mut self) -> Option<u64> {
        if self.tail == NIL {
            return None;
        }
        let slot = self.tail;
        self.unlink(slot);
        self.free.push(slot);
        self.len -= 1;
        Some(self.nodes[slot as usize].key)
    }

    /// Keys from most to least recently touched (for tests and inspection).
    pub fn keys_mru(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.len);
        let mut cur = self.head;
        while cur != NIL {
            out.push(self.nodes[cur as usize].key);
            cur = self.nodes[cur as usize].next;
        }
        out
    }

    fn link_head(&mut self, slot: u32) {
        if self.head != NIL {
            self.nodes[self.head as usize].prev = slot;
        }
        self.head = slot;
        if self.tail == NIL {
            self.tail = slot;
        }
    }

    fn unlink(&mut self, slot: u32) {
        let Node { prev, next, .. } = self.nodes[slot as usize];
        if prev == NIL {
            self.head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.nodes[next as usize].prev = prev;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn order_and_eviction() {
        let mut lru = Lru::default();
        let a = lru.push_front(1);
        lru.push_front(2);
        lru.push_front(3);
        assert_eq!(lru.keys_mru(), vec![3, 2, 1]);
        lru.move_to_front(a);
        assert_eq!(lru.keys_mru(), vec![1, 3, 2]);
        assert_eq!(lru.pop_back(), Some(2));
        assert_eq!(lru.pop_back(), Some(3));
        lru.push_front(4); // reuses a freed slot
        assert_eq!(lru.keys_mru(), vec![4, 1]);
        assert_eq!(lru.len(), 2);
        assert_eq!(lru.pop_back(), Some(1));
        assert_eq!(lru.pop_back(), Some(4));
        assert_eq!(lru.pop_back(), None);
        assert!(lru.is_empty());
    }
}
