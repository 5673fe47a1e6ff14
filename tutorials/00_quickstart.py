"""Quickstart: the millionaires' problem on two simulated parties.

The program lives in `mpplug/demo.py` so that `mpplug demo` runs the same code on any install;
read it there. Alice and Bob each put a private value, one program compares them at Alice,
and only the answer is fetched.
"""

from mpplug.demo import main

if __name__ == "__main__":
    main()
