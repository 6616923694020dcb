"""Validation against robots the project did not write (issue 17, item 6).

* :mod:`.independent` -- an independently written MuJoCo model of a structure's TRUE robot (capsule bars with
  their own inertia, tendons, spool actuators, a string law per string) and a recorder with a lab's habits
  that writes a rosbag2 recording ``tensegrity identify`` reads.
* ``structures/`` -- nominal structure files of robots that are not in ``config/`` (generated once by
  ``python -m tensegrity_ros.validation.independent --form-find``).

Nothing here is imported by the engine, the twin or identification: it only uses the structure schema, the
references and the bag writer, so agreement with it is evidence, not consistency.
"""
